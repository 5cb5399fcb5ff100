"""The auto periods' plan: the planner model's recommendation for a run's measured costs, with the snapshot
floor. The run asks it while it trains (`trainer.elastic.periods.AutoPeriods`), `python -m trainer.plan`
when it recommends periods for a run directory: both the same function.

The failures it weighs for the persistent tier are the share `process_kill_share` that take the process
down: the others are recovered in the process. The snapshot tier has one more rule (`max_overhead`, the
config's `auto_snapshot_max_overhead`): at rare failure rates the model's optimum is hundreds of steps
apart, yet a pinned-host snapshot costs little. As long as snapshots cost at most that share of step
time, they are taken at least that often (never sooner than the previous copy finishes), so a failure
rewinds a few steps, not hundreds.
"""

from __future__ import annotations

import dataclasses
import math

from trainer.plan import model


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
    expected_goodput: float | None = None  # the model's goodput of the run at `periods` (None: not computed)


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
    outcome = model.expected(costs, failures, model.Periods(**chosen), steps, mode)
    return Plan(chosen, recommended, costs, mtbf_per_slice_s, rate_source, mode, outcome.goodput)
