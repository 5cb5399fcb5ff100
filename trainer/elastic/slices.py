"""Slice health behind pathwaysutils' interface, for Pathways and for local virtual slices.

The supervisor only calls `pathwaysutils.elastic.elastic.wait_for_slices` / `get_active_slice_indices`
with a `SliceHealthChecker`. On Pathways that is pathwaysutils' own `DefaultSliceHealthChecker` over
devices grouped by `slice_index`; locally it is `VirtualSliceHealthChecker`, which runs the same
per-slice test computation and additionally reports the slices that the fault injector took down.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set

import jax
from pathwaysutils.elastic import elastic as pw_elastic

from trainer.elastic.faults import Outages


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
