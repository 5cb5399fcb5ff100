"""Save periods set to `auto`: planned while the run trains, from its own measured costs.

The model is `trainer.plan`'s, fed what `python -m trainer.plan RUN_DIR` measures from the same run
directory (`trainer.plan.costs.measure`), so the trainer's choice is the tool's recommendation for the
run so far. The failure rate is `expected_mtbf_per_chip_hours` until the run has failures of its own,
then its observed rate (failures per second of training wall time, per slice).

When it plans:
- after a warm-up of `WARMUP_STEPS` steps of the first attempt, during which an auto snapshot tier takes
  a snapshot every other step, an auto local tier saves twice and an auto persistent tier once (so each
  kind of step is measured);
- again after the warm-up of every attempt that follows a failure (the observed rate changed);
- again at steps 2x, 4x, ... the first planning step (costs drift: a bigger eval, a slower disk).
Each plan is logged as `periods_planned` (a handful per run: the plans are spaced geometrically).

The persistent tier (`checkpoint_period=auto`) is planned once its save has been measured (until then
the unplanned default period holds); the failures it is weighed against are the share
`expected_process_kill_share` that take the process down: the others are recovered in the process.

The snapshot tier has one more rule (`auto_snapshot_max_overhead`): at rare failure rates the model's
optimum is hundreds of steps apart, yet a pinned-host snapshot costs little. As long as snapshots cost at
most that share of step time, they are taken at least that often (never sooner than the previous copy
finishes), so a failure rewinds a few steps, not hundreds.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable

from trainer.config.schema import AUTO
from trainer.observe import catalogue
from trainer.plan import model

log = logging.getLogger(__name__)

WARMUP_STEPS = 8
KEYS = {"snapshot": "snapshot_period", "local": "local_checkpoint_period", "checkpoint": "checkpoint_period"}
UNPLANNED_CHECKPOINT_PERIOD = 10_000  # = trainer.checkpoint.checkpointer's


def measurable_tiers(costs: model.Costs, enabled: tuple[str, ...]) -> tuple[str, ...]:
    """The enabled tiers the model can weigh: the persistent one always, another only once its costs are
    known (measured or given), else it would look free."""
    return tuple(
        t
        for t in enabled
        if t == "checkpoint" or any(getattr(costs, f"{t}_{c}_s") for c in ("save", "write", "restore"))
    )


def snapshot_floor(costs: model.Costs, max_overhead: float) -> int | None:
    """The shortest snapshot period whose snapshots cost at most `max_overhead` of step time and that the
    previous copy has finished by; None when the rule is off."""
    if max_overhead <= 0 or costs.step_s <= 0:
        return None
    by_cost = math.ceil(costs.snapshot_save_s / (max_overhead * costs.step_s) - 1e-9)
    by_write = math.ceil(costs.snapshot_write_s / costs.step_s - 1e-9)
    return max(1, by_cost, by_write)


@dataclasses.dataclass(frozen=True)
class Plan:
    periods: dict[str, int]  # tier -> steps (0 = off), what the run uses
    recommended: dict[str, int]  # the model's periods, before the snapshot floor
    costs: model.Costs
    mtbf_per_slice_s: float
    rate_source: str  # "expected" (the config's prior) or "observed"
    mode: str


def plan(
    costs: model.Costs,
    *,
    slices: int,
    mtbf_per_slice_s: float,
    steps: int,
    mode: str,
    enabled: tuple[str, ...],
    fixed: dict[str, int],
    max_overhead: float,
    rate_source: str = "expected",
    process_kill_share: float = 0.0,
) -> Plan:
    """The periods for `enabled` tiers (the ones in `fixed` keep the user's number)."""
    available = measurable_tiers(costs, enabled)
    failures = model.Failures(slices, mtbf_per_slice_s, process_kill_share)
    periods, _ = model.recommend(costs, failures, steps, mode, available=available, fixed=fixed)
    recommended = {t: periods.of(t) for t in model.TIERS}
    chosen = dict(recommended)
    floor = snapshot_floor(costs, max_overhead)
    if "snapshot" in available and "snapshot" not in fixed and floor is not None:
        chosen["snapshot"] = min(recommended["snapshot"] or steps, floor)
    return Plan(chosen, recommended, costs, mtbf_per_slice_s, rate_source, mode)


@dataclasses.dataclass
class FixedPeriods:
    """Periods given as numbers: nothing to plan."""

    snapshot: int = 0
    local: int = 0

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

    `measure()` -> (Costs, failures seen) of the run so far (from its run directory); `clock` is wall time."""

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
        measure: Callable[[], tuple[model.Costs, int]],
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
        self.plans: list[Plan] = []

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

    def after_step(self, step: int) -> None:
        if self.next_plan is None or step < self.next_plan:
            return
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
        p = plan(
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
        )
