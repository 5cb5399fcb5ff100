"""One controller sees every slice: Pathways single-controller, or local virtual slices.

Slice health is pathwaysutils' (`wait_for_slices` with a checker from `trainer.elastic.slices.make_checker`:
its own on Pathways, one that also knows the injected outages on virtual slices); a `JaxRuntimeError` is a
slice-down event when pathwaysutils classifies it so. On local virtual slices the `FaultInjector` fires
scheduled faults and `trainer.chaos` requests at step boundaries and fails a step that runs on a down
slice with Pathways' error; `ReturnPoller` notices slices that are healthy again. Snapshots are pinned
host copies on the devices' hosts (`trainer.elastic.pinned_snapshots`); a virtual slice's loss takes the
snapshot replicas it held, as a real slice's does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

from jax.experimental.multihost_utils import ProcessFailureError
from pathwaysutils.elastic import elastic as pw_elastic

from trainer.attempt.builder import AttemptParts
from trainer.elastic.cluster import ActiveSlices, Cluster
from trainer.elastic.faults import FaultInjector
from trainer.elastic.slices import ReturnPoller, make_checker
from trainer.elastic.snapshot import HostSnapshots
from trainer.failures.slice_loss import Outages

log = logging.getLogger(__name__)


class LocalCluster(Cluster):
    """`slices`: each slice's devices, by slice index. `outages` are the injector's down slices (local
    virtual slices), `injector` the `FaultInjector` (None on Pathways); `timeout_s` bounds a wait for
    slices, `poll_s` spaces the health checks (while waiting, and of inactive slices between steps)."""

    compiles_ahead = True  # one controller keeps its devices across attempts: survivor executables stay valid

    def __init__(
        self,
        slices: list[list],
        *,
        timeout_s: float,
        poll_s: float,
        outages: Outages | None = None,
        injector: FaultInjector | None = None,
        single_controller: bool = False,
    ):
        self.slice_to_devices = dict(enumerate(slices))
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.outages = outages
        self.injector = injector
        self.single_controller = single_controller
        self.checker = make_checker(self.slice_to_devices, outages, single_controller=single_controller)
        self._snapshots: HostSnapshots | None = None  # the attempt's: a virtual slice's loss takes its replicas

    @property
    def num_slices(self) -> int:
        return len(self.slice_to_devices)

    def wait_for_slices(self, min_slices: int) -> ActiveSlices:
        active = pw_elastic.wait_for_slices(
            slice_count=min_slices,
            poll_interval=self.poll_s,
            timeout=self.timeout_s,
            slice_to_devices=self.slice_to_devices,
            checker=self.checker,
        )
        return ActiveSlices(sorted(active))

    def devices(self, active: Sequence[int]) -> list[list]:
        return [self.slice_to_devices[i] for i in active]

    def slice_down_cause(self, err: Exception) -> str | None:
        if isinstance(err, ProcessFailureError):
            return "peer_lost"
        if not pw_elastic.is_error_due_to_slice_down(err, log_traceback=False):
            return None
        if self.outages is not None and self._snapshots is not None:
            # On Pathways a lost slice's host memory goes with it; a virtual slice's must go too.
            down = self.outages.down(self.slice_to_devices)
            self._snapshots.lose([d for i in down for d in self.slice_to_devices[i]])
        return "slice_down"

    def quarantine(self, slice_index: int) -> bool:
        """Treat a slice that computed wrong numbers as lost from now on (sdc_quarantine): on virtual
        slices it is down for good, with the replicas of its snapshots. False where that cannot be done
        (Pathways: the controller cannot take a healthy-looking slice out of service)."""
        if self.outages is None:
            return False
        self.outages.mark_down(slice_index, math.inf)
        if self._snapshots is not None:
            self._snapshots.lose(list(self.slice_to_devices[slice_index]))
        return True

    def attempt_parts(self, active: list[int], snapshots: HostSnapshots) -> AttemptParts:
        injector = self.injector
        self._snapshots = snapshots
        if injector is None:
            return AttemptParts(snapshots=snapshots)
        on = {i: self.slice_to_devices[i] for i in active}
        return AttemptParts(
            snapshots=snapshots,
            wrap_step=lambda fn: injector.guard(fn, on),
            wrap_replay=lambda fn: injector.guard_replay(fn, on),
        )

    def at_step_boundary(self, next_step: int, in_flight=None) -> None:
        if self.injector is not None:
            self.injector.at_step_boundary(next_step, in_flight=in_flight)

    def returning(self, active: list[int]) -> Callable[[], list[int]]:
        return ReturnPoller(
            self.slice_to_devices,
            active,
            self.outages,
            single_controller=self.single_controller,
            interval_s=self.poll_s,
        )
