"""The snapshot, local-tier and persistent-tier periods a run saves by: numbers, or planned while it trains.

The step boundary (`trainer.elastic.boundary`) asks `due(tier, step)` every step; the checkpointer asks
`checkpoint_due(step)` when `checkpoint_period` is planned. `FixedPeriods` holds numbers given in the
config. `AutoPeriods` plans the tiers set to `auto` from the run's own measured costs (`measure`) with a
planner (`trainer.plan.auto.plan`, the model `python -m trainer.plan RUN_DIR` recommends from the same
run directory). The failure rate is `expected_mtbf_per_chip_hours` until the run has failures of its own,
then its observed rate (failures per second of training wall time, per slice).

When it plans:
- after a warm-up of `WARMUP_STEPS` steps of the first attempt, during which an auto snapshot tier takes
  a snapshot every other step, an auto local tier saves twice and an auto persistent tier once (so each
  kind of step is measured);
- again after the warm-up of every attempt that follows a failure (the observed rate changed);
- again at steps 2x, 4x, ... the first planning step (costs drift: a bigger eval, a slower disk);
- at the step after an operator asks (`plan_now`: the control endpoint's `replan`), from the costs
  measured so far, the schedule above going on as before.
Each plan is an event `periods_planned` (the plans are spaced geometrically).

The persistent tier (`checkpoint_period=auto`) is planned once its save has been measured (until then
the unplanned default period holds). Which periods a job may plan at all is its backend's answer
(`trainer.elastic.backends`: several processes take numbers only).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from trainer.config.schema import AUTO, UNPLANNED_CHECKPOINT_PERIOD
from trainer.observe import catalogue

log = logging.getLogger(__name__)

WARMUP_STEPS = 8
KEYS = {"snapshot": "snapshot_period", "local": "local_checkpoint_period", "checkpoint": "checkpoint_period"}


@dataclasses.dataclass(frozen=True)
class PeriodKeys:
    """The three period keys as a run gives them (a number, 0 for off, or AUTO)."""

    snapshot: int
    local: int
    checkpoint: int


class Planner(Protocol):
    """`trainer.plan.auto.plan`: the periods of the `enabled` tiers for measured `costs` (a `Plan`, with
    `.periods`, `.recommended` and `.mode`)."""

    def __call__(
        self,
        costs,
        *,
        slices: int,
        mtbf_per_slice_s: float,
        steps: int,
        mode: str,
        enabled: tuple[str, ...],
        fixed: dict[str, int],
        max_overhead: float,
        rate_source: str = ...,
        process_kill_share: float = ...,
    ) -> Any: ...


@dataclasses.dataclass
class FixedPeriods:
    """Periods given as numbers: nothing to plan."""

    snapshot: int = 0
    local: int = 0
    auto = frozenset()  # the tiers whose period is planned: none

    def attempt_started(self, start_step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def due(self, tier: str, step: int) -> bool:
        """Every `period` steps: at the steps divisible by it."""
        period = getattr(self, tier)
        return bool(period) and step % period == 0

    def saved(self, step: int, *, persisted: bool) -> None:
        pass

    checkpoint_due = None  # the checkpointer's own period


class AutoPeriods:
    """The snapshot and local-tier periods the step boundary reads every step; `auto` ones are planned.

    `measure()` -> (costs, failures seen) of the run so far (from its run directory: `trainer.plan.costs`);
    `planner` turns them into periods (`trainer.plan.auto.plan`); `clock` is wall time."""

    def __init__(
        self,
        *,
        snapshot: int,
        local: int,
        checkpoint: int,
        steps: int,
        slices: int,
        devices_per_slice: int,
        mode: str,
        mtbf_per_chip_s: float,
        max_overhead: float,
        events,
        measure: Callable[[], tuple[Any, int]],
        planner: Planner,
        clock: Callable[[], float] = time.time,
        process_kill_share: float = 0.0,
    ):
        self.auto = {
            t for t, v in (("snapshot", snapshot), ("local", local), ("checkpoint", checkpoint)) if v == AUTO
        }
        if mode == "full_restart":  # snapshots live in the process: only in-process recovery uses them
            snapshot = 0 if snapshot == AUTO else snapshot
            self.auto.discard("snapshot")
        self.enabled = tuple(
            t for t, v in (("snapshot", snapshot), ("local", local), ("checkpoint", checkpoint)) if v
        )
        self.fixed = {
            t: v
            for t, v in (("snapshot", snapshot), ("local", local), ("checkpoint", checkpoint))
            if v and t not in self.auto
        }
        self.process_kill_share = process_kill_share
        self.steps = steps
        self.slices = slices
        self.prior_mtbf_per_slice_s = mtbf_per_chip_s / max(1, devices_per_slice)
        self.mode = mode
        self.max_overhead = max_overhead
        self.events = events
        self.measure = measure
        self.planner = planner
        self.clock = clock
        # During the warm-up: a snapshot every other step, the local tier twice, the persistent tier once
        # (attempt_started).
        self.current = {
            "snapshot": 2 if "snapshot" in self.auto else snapshot,
            "local": WARMUP_STEPS // 2 if "local" in self.auto else local,
            "checkpoint": UNPLANNED_CHECKPOINT_PERIOD if "checkpoint" in self.auto else checkpoint,
        }
        self.checkpoint_measured = False  # a save's cost has been measured: the persistent tier is planned
        self.started_at: float | None = None
        self.last: dict[str, int] = {}
        self.next_plan: int | None = None
        self.interval = WARMUP_STEPS
        self.plans: list = []  # every plan made (the planner's `Plan`s)
        self.asked = False  # plan_now: plan after the next step

    @property
    def snapshot(self) -> int:
        return self.current["snapshot"]

    def due(self, tier: str, step: int) -> bool:
        """A planned tier saves `period` steps after its previous save (a new period applies from the
        save before it); a given one at the steps divisible by its period."""
        period = self.current[tier]
        if not period:
            return False
        if tier in self.auto:
            return step - self.last.get(tier, 0) >= period
        return step % period == 0

    def saved(self, step: int, *, persisted: bool) -> None:
        """A snapshot of `step` was taken (`persisted`: also written to the local tier)."""
        self.last["snapshot"] = step
        if persisted:
            self.last["local"] = step

    @property
    def local(self) -> int:
        return self.current["local"]

    @property
    def checkpoint_due(self) -> Callable[[int], bool] | None:
        """The persistent tier's schedule for the checkpointer (None: the checkpointer's own period)."""
        return self._checkpoint_due if "checkpoint" in self.auto else None

    def _checkpoint_due(self, step: int) -> bool:
        """A planned period counts from the previous periodic save; the warm-up's save happens once."""
        if not self.due("checkpoint", step):
            return False
        self.last["checkpoint"] = step
        if not self.checkpoint_measured:
            self.current["checkpoint"] = UNPLANNED_CHECKPOINT_PERIOD
        return True

    def attempt_started(self, start_step: int) -> None:
        """A new attempt: plan after its warm-up (the first one measures costs; a later one follows a
        failure, so the observed rate changed)."""
        if self.started_at is None:
            self.started_at = self.clock()
            self.last["checkpoint"] = start_step  # a later attempt keeps counting from the last save
        self.last.update(snapshot=start_step, local=start_step)  # what it restored is saved already
        if "checkpoint" in self.auto and not self.checkpoint_measured:
            self.current["checkpoint"] = WARMUP_STEPS // 2
            self.last["checkpoint"] = start_step
        if self.auto:
            self.next_plan = start_step + WARMUP_STEPS
            self.interval = max(self.interval, WARMUP_STEPS)

    def plan_now(self) -> None:
        """Plan after the next step (an operator's request), whatever the schedule."""
        self.asked = True

    def after_step(self, step: int) -> None:
        asked, self.asked = self.asked, False
        scheduled = self.next_plan is not None and step >= self.next_plan
        if not (asked or scheduled):
            return
        if scheduled:
            self.interval *= 2
            self.next_plan = step + self.interval
        try:
            self._plan(step)
        except Exception as e:  # planning must never cost the run: keep the current periods
            log.warning("auto periods: planning at step %d failed (%s); keeping %s", step, e, self.current)

    def _plan(self, step: int) -> None:
        costs, failures = self.measure()
        if costs.step_s <= 0:
            return
        now = self.clock()
        elapsed = max(1e-9, now - (now if self.started_at is None else self.started_at))
        if failures:
            mtbf, source = self.slices * elapsed / failures, "observed"
        else:
            mtbf, source = self.prior_mtbf_per_slice_s, "expected"
        fixed = dict(self.fixed)
        if "checkpoint" in self.auto:
            self.checkpoint_measured = costs.checkpoint_save_s > 0
            if not self.checkpoint_measured:  # its save still to come: weigh the unplanned period
                fixed["checkpoint"] = self.current["checkpoint"]
        p = self.planner(
            costs,
            slices=self.slices,
            mtbf_per_slice_s=mtbf,
            steps=self.steps,
            mode=self.mode,
            enabled=self.enabled,
            fixed=fixed,
            max_overhead=self.max_overhead,
            rate_source=source,
            process_kill_share=self.process_kill_share,
        )
        self.plans.append(p)
        self.current.update({t: p.periods[t] for t in self.auto if t not in fixed})
        if "checkpoint" in self.auto and not self.current["checkpoint"]:
            self.current["checkpoint"] = self.steps  # the model's "never" still saves the final step
        self.events.emit(
            catalogue.PERIODS_PLANNED,
            step=step,
            snapshot_period=self.current["snapshot"],
            local_checkpoint_period=self.current["local"],
            checkpoint_period=self.current["checkpoint"],
            recommended={KEYS[t]: v for t, v in p.recommended.items()},
            mode=p.mode,
            mtbf_per_slice_s=round(mtbf, 3),
            process_kill_share=self.process_kill_share,
            rate=source,
            failures=failures,
            costs={k: round(v, 6) for k, v in dataclasses.asdict(costs).items()},
            expected_goodput=None if p.expected_goodput is None else round(p.expected_goodput, 4),
        )
