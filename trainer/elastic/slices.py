"""Slice health behind pathwaysutils' interface, for Pathways and for local virtual slices.

The supervisor only calls `pathwaysutils.elastic.elastic.wait_for_slices` / `get_active_slice_indices`
with a `SliceHealthChecker`. On Pathways that is pathwaysutils' own `DefaultSliceHealthChecker` over
devices grouped by `slice_index`; locally it is `VirtualSliceHealthChecker`, which runs the same
per-slice test computation and additionally reports the slices that the fault injector took down.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence, Set

import jax
from pathwaysutils.elastic import elastic as pw_elastic

from trainer.failures.slice_loss import Outages


class VirtualSliceHealthChecker(pw_elastic.DefaultSliceHealthChecker):
    """pathwaysutils' health check, minus the virtual slices that are currently down."""

    def __init__(self, slice_to_devices: Mapping[int, Sequence[jax.Device]], outages: Outages):
        super().__init__(slice_to_devices)
        self.outages = outages

    def dispatch(self) -> None:
        self._down = set(self.outages.down(self.slice_to_devices))
        live = {i: d for i, d in self.slice_to_devices.items() if i not in self._down}
        self.results = {i: self._simple_execution(d) for i, d in live.items()}

    def validate(self) -> Set[int]:
        return frozenset(super().validate()) - self._down


def make_checker(
    slice_to_devices: Mapping[int, Sequence[jax.Device]], outages: Outages | None, *, single_controller: bool
) -> pw_elastic.SliceHealthChecker:
    if single_controller:
        return pw_elastic.DefaultSliceHealthChecker(slice_to_devices)
    return VirtualSliceHealthChecker(slice_to_devices, outages or Outages())


class ReturnPoller:
    """Inactive slices that are healthy again, by the same health check as `wait_for_slices`, asked at
    most every `interval_s` (a check runs a small computation on each inactive slice)."""

    def __init__(
        self,
        slice_to_devices: Mapping[int, Sequence[jax.Device]],
        active: Sequence[int],
        outages: Outages | None,
        *,
        single_controller: bool,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.inactive = {i: d for i, d in slice_to_devices.items() if i not in set(active)}
        self.outages = outages
        self.single_controller = single_controller
        self.interval_s = interval_s
        self.clock = clock
        self.next_check = clock()

    def __call__(self) -> list[int]:
        if not self.inactive or self.clock() < self.next_check:
            return []
        self.next_check = self.clock() + self.interval_s
        checker = make_checker(self.inactive, self.outages, single_controller=self.single_controller)
        return sorted(pw_elastic.get_active_slice_indices(self.inactive, checker))
