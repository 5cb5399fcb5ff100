"""Expected goodput of a run under random failures: a closed form and a Monte Carlo of the same phases.

The phases are the ones the trainer records and `trainer.observe.goodput` accounts, so every badput term
lands in one of the report's categories:

- startup_compile: process start to the first step (once; again after every full restart);
- checkpoint_save: the loop blocked by a persistent save (`checkpoint_save_blocked`, per save);
- restore: reading the state back after a failure, from the tier that holds the newest step;
- wasted_progress: steps computed since that step, then rewound;
- waiting_for_slices: pause-and-resume waiting for the lost slice to be rescheduled;
- other: detecting the failure and tearing the attempt down, the gaps between steps, the run's tail,
  and a full restart's rescheduling delay.

Productive time is counted as the report counts it: the time of the steps that survived, including the
slowdown async saves (host snapshots, local saves) impose on the steps they overlap and the slower first
step after a recovery. Those costs are real, so the periods are chosen to minimise the expected wall time
of the run (`useful_goodput` = steps x undisturbed step time / wall), not the report's goodput.

Failures: Poisson in wall time once training has started, at `Failures.rate_s`. A failure is noticed at
the next step boundary, after the step in flight (the rule of `fault_schedule`); one that falls in a
recovery kills that recovery's first step. A share `process_kill_share` of failures takes the process
with it (host snapshots lost; restored from the local tier or the persistent one after a restart).

Giving up: the trainer's rule (`trainer.elastic.retry_budget`): more than `max_retries` failures within
`window_steps` steps of net progress end the run with exit 3. The Monte Carlo applies it exactly; the
closed form gives the chance of it (`Outcome.gave_up`) from the failures per step of progress.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random

import numpy as np

from trainer.elastic.retry_budget import RetryBudget

MODES = ("pause_resume", "replica_resize", "full_restart")
TIERS = ("snapshot", "local", "checkpoint")  # restore preference on a tie (RAM, node disk, persistent)


@dataclasses.dataclass(frozen=True)
class Costs:
    """What each phase costs, in seconds (measured from a run's events, or given)."""

    step_s: float  # one undisturbed training step
    startup_s: float = 0.0  # process start to the first step: init, compile (startup_compile)
    step_gap_s: float = 0.0  # between steps, outside step_time_s (other)
    tail_s: float = 0.0  # last step to the end of the run: final save commit, shutdown (other)
    first_step_extra_s: float = 0.0  # first step of an attempt beyond step_s (productive, as reported)
    checkpoint_save_s: float = 0.0  # loop blocked per persistent save (checkpoint_save)
    local_save_s: float = 0.0  # slowdown per local save (async: productive, as reported)
    snapshot_save_s: float = 0.0  # slowdown per host snapshot (async: productive, as reported)
    checkpoint_write_s: float = 0.0  # save start to commit: a save due sooner waits for the previous one
    local_write_s: float = 0.0
    snapshot_write_s: float = 0.0
    checkpoint_restore_s: float = 0.0
    local_restore_s: float = 0.0
    snapshot_restore_s: float = 0.0
    init_s: float = 0.0  # a failure before any save: the state initialised again (restore)
    detect_s: float = 0.0  # failure noticed -> attempt rebuilt, beyond waiting and restoring (other)
    reschedule_s: float = 0.0  # a lost slice back in service (pause-and-resume waits for it)
    restart_s: float = 0.0  # a full restart: the job rescheduled before its process starts (other)


@dataclasses.dataclass(frozen=True)
class Failures:
    slices: int
    mtbf_per_slice_s: float = math.inf
    process_kill_share: float = 0.0

    @property
    def rate_s(self) -> float:
        return self.slices / self.mtbf_per_slice_s


@dataclasses.dataclass(frozen=True)
class Periods:
    """Save periods in steps; 0 turns a tier off (the persistent tier always saves the final step)."""

    checkpoint: int
    local: int = 0
    snapshot: int = 0

    def of(self, tier: str) -> int:
        return getattr(self, tier)


@dataclasses.dataclass(frozen=True)
class Outcome:
    wall_s: float
    productive_s: float
    useful_s: float  # steps x step_s: what the run would take with no saves, no failures, no overheads
    failures: float
    badput_s: dict[str, float]
    gave_up: float = 0.0  # chance (closed form), or share of replayed runs, that the retry budget ends the run

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def useful_goodput(self) -> float:
        return self.useful_s / self.wall_s if self.wall_s > 0 else 0.0


def clamp(periods: Periods, steps: int) -> Periods:
    """Periods longer than the run save only where the run does (the persistent tier: its final step)."""
    return Periods(*(min(p, steps) if p else 0 for p in (periods.checkpoint, periods.local, periods.snapshot)))


def save_cost(costs: Costs, tier: str, period: int) -> float:
    """Seconds one save costs the run: its blocked time (or step slowdown, for an async tier), plus the
    wait for the previous save when saves come faster than one is written."""
    blocked = {
        "checkpoint": costs.checkpoint_save_s,
        "local": costs.local_save_s,
        "snapshot": costs.snapshot_save_s,
    }
    write = {
        "checkpoint": costs.checkpoint_write_s,
        "local": costs.local_write_s,
        "snapshot": costs.snapshot_write_s,
    }
    return blocked[tier] + max(0.0, write[tier] - blocked[tier] - period * costs.step_s)


def save_counts(steps: int, periods: Periods) -> dict[str, int]:
    """Saves per tier over `steps`: the persistent tier at its period and the final step; local saves on
    the steps the persistent tier does not save; snapshots at their period."""
    ckpt = steps // periods.checkpoint + (steps % periods.checkpoint != 0)
    local = 0
    if periods.local:
        local = steps // periods.local - steps // math.lcm(periods.local, periods.checkpoint)
        local -= steps % periods.local == 0 and steps % periods.checkpoint != 0  # the final step is persistent
    snap = steps // periods.snapshot if periods.snapshot else 0
    return {"checkpoint": ckpt, "local": local, "snapshot": snap}


def restore_point(done: int, periods: Periods, tiers: tuple[str, ...]) -> tuple[int, str]:
    """(step, tier) restored after a failure when `done` steps had completed and `tiers` survive it
    ("init": nothing saved yet, the state is initialised again)."""
    best, source = 0, "init"
    for tier in tiers:
        p = periods.of(tier)
        if p and (done // p) * p > best:
            best, source = (done // p) * p, tier
    return best, source


@functools.lru_cache(maxsize=4096)
def lost_and_source(periods: Periods, tiers: tuple[str, ...], horizon: int = 20_000) -> tuple[float, dict]:
    """Expected steps rewound by a failure at a uniformly random step, and the share restored from each
    tier (newest step wins; a tie goes to the faster tier), over one full cycle of the periods (or
    `horizon` steps when that cycle is longer)."""
    active = [periods.of(t) for t in tiers if periods.of(t)] or [periods.checkpoint]
    cycle = min(math.lcm(*active), horizon)
    done = np.arange(cycle, dtype=np.int64) + cycle  # one cycle in: every tier has saved
    best = np.zeros(cycle, dtype=np.int64)
    source = np.full(cycle, TIERS.index("checkpoint"))  # (never chosen: one cycle in, every tier has saved)
    for tier in tiers:
        p = periods.of(tier)
        if p:
            saved = (done // p) * p
            newer = saved > best
            best = np.where(newer, saved, best)
            source = np.where(newer, TIERS.index(tier), source)
    share = {t: float(np.mean(source == i)) for i, t in enumerate(TIERS)}
    return float(np.mean(done - best)), share


@dataclasses.dataclass(frozen=True)
class _Recovery:
    """One kind of failure: its share of all failures, the tiers it can restore from, its costs by
    category (besides the restore read and the rewound steps), and how many attempts it starts."""

    share: float
    tiers: tuple[str, ...]
    badput: dict[str, float]
    first_steps: int = 1


def _recoveries(costs: Costs, failures: Failures, mode: str) -> list[_Recovery]:
    q = failures.process_kill_share
    restart = {"other": costs.detect_s + costs.restart_s, "startup_compile": costs.startup_s}
    # A process killed on nodes that stay keeps their local tier; a lost slice's nodes are replaced.
    killed = _Recovery(q, ("local", "checkpoint"), restart)
    if mode == "full_restart":
        return [killed, _Recovery(1 - q, ("checkpoint",), restart)]
    if mode == "replica_resize" and failures.slices > 1:
        # Survivors carry on; the lost slice's share of the work waits for its return. Scaling back up
        # costs one more state transfer and first step.
        bad = {
            "other": costs.detect_s,
            "waiting_for_slices": costs.reschedule_s / failures.slices,
            "restore": costs.snapshot_restore_s,
        }
        return [killed, _Recovery(1 - q, TIERS, bad, first_steps=2)]
    return [killed, _Recovery(1 - q, TIERS, {"other": costs.detect_s, "waiting_for_slices": costs.reschedule_s})]


def _reads(costs: Costs) -> dict[str, float]:
    return {
        "snapshot": costs.snapshot_restore_s,
        "local": costs.local_restore_s,
        "checkpoint": costs.checkpoint_restore_s,
        "init": costs.init_s,
    }


def lost_steps(period: int, rho: float) -> float:
    """Expected steps rewound when training restarts at a save point and fails after a geometric number
    of steps k (P(k) = rho^(k-1) (1 - rho), k >= 1: the step in flight completes): E[k mod period]."""
    if period <= 1:
        return 0.0
    if 1 - rho < 1e-12:
        return (period - 1) / 2
    if period > 20_000:  # closed form of the sum below (exact; the sum itself is slow this long)
        tail = rho ** (period - 1)
        head = (1 - (period + 1) * tail * rho + period * tail * rho * rho) / (1 - rho) ** 2
        return (head - period * tail) * (1 - rho) / (1 - tail * rho)
    j = np.arange(1, period + 1, dtype=np.float64)
    weights = np.exp((j - 1) * math.log(max(rho, 1e-300)))
    return float(np.sum((j % period) * weights) / np.sum(weights))


def give_up_chance(failures: float, steps: int, budget: RetryBudget) -> float:
    """The chance the retry budget ends a run of `steps` steps that expects `failures` failures: failures
    per step of progress taken as Poisson, a window of `window_steps` over the run's length (about two
    independent windows per window length, as they slide)."""
    if failures <= 0 or steps <= 0:
        return 0.0
    if math.isinf(failures):
        return 1.0
    mean = failures / steps * budget.window_steps
    k = budget.max_retries + 1  # P(N >= k), summed from its first term (no cancellation when it is tiny)
    term = math.exp(-mean + k * math.log(mean) - math.lgamma(k + 1)) if mean > 0 else 0.0
    exceed, n = 0.0, k
    while term > 1e-300 and n < k + 10_000:
        exceed += term
        n += 1
        term *= mean / n
        if term < exceed * 1e-17:
            break
    windows = max(1.0, 2.0 * steps / budget.window_steps)
    return -math.expm1(windows * math.log1p(-min(exceed, 1.0 - 1e-16)))


DEFAULT_BUDGET = RetryBudget()  # the trainer's defaults (elastic_max_retries, elastic_retry_window_steps)


def expected(
    costs: Costs, failures: Failures, periods: Periods, steps: int, mode: str, budget: RetryBudget = DEFAULT_BUDGET
) -> Outcome:
    """Expected value over failure cycles (renewal reward), exact for the failure rule above up to where
    within the save cycle training restarts.

    Between two failures noticed, a run restores, and then either a failure that fell in the recovery
    kills its first step (probability a = 1 - exp(-rate x recovery time)), or it trains a geometric number
    of steps k (mean 1 / (1 - rho), rho = exp(-rate x time per step)) and rewinds k mod period of them.
    Failures = steps / progress per cycle; every cost is a count times a per-event cost.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    periods = clamp(periods, steps)
    n = save_counts(steps, periods)
    per_step = costs.step_s + costs.step_gap_s
    cost = {t: save_cost(costs, t, periods.of(t)) if periods.of(t) else 0.0 for t in TIERS}
    async_slowdown = n["local"] * cost["local"] + n["snapshot"] * cost["snapshot"]
    base = steps * per_step + async_slowdown + n["checkpoint"] * cost["checkpoint"] + costs.first_step_extra_s
    bad = dict.fromkeys(("startup_compile", "checkpoint_save", "restore", "wasted_progress"), 0.0)
    bad |= {"waiting_for_slices": 0.0, "other": costs.tail_s + steps * costs.step_gap_s}
    bad["startup_compile"] = costs.startup_s
    bad["checkpoint_save"] = n["checkpoint"] * cost["checkpoint"]
    rate = failures.rate_s
    recoveries = [r for r in _recoveries(costs, failures, mode) if r.share > 0] if rate > 0 else []
    f = lost_per_cycle = 0.0
    first_steps = 1.0
    if recoveries:
        reads = _reads(costs)
        rho = math.exp(-rate * base / steps)
        read, lost, down = [], [], []
        for r in recoveries:
            _, share = lost_and_source(periods, r.tiers)
            period = min((periods.of(t) for t in r.tiers if periods.of(t)), default=periods.checkpoint)
            early = min(1.0, period / steps)  # a failure before the first save initialises again
            read.append((1 - early) * sum(share[t] * reads[t] for t in TIERS) + early * costs.init_s)
            lost.append((lost_steps(period, rho), float(period > 1)))
            down.append(read[-1] + sum(r.badput.values()) + r.first_steps * costs.first_step_extra_s)
        a = sum(r.share * -math.expm1(-rate * d) for r, d in zip(recoveries, down, strict=True))
        lost_if_trained = sum(r.share * lost_i[0] for r, lost_i in zip(recoveries, lost, strict=True))
        lost_if_pending = sum(r.share * lost_i[1] for r, lost_i in zip(recoveries, lost, strict=True))
        progress = (1 - a) * (1 / (1 - rho) - lost_if_trained) + a * (1 - lost_if_pending)
        if progress <= 0:  # every recovery is killed before it saves: no progress
            inf = math.inf
            return Outcome(inf, 0.0, steps * costs.step_s, inf, dict(bad, other=inf), gave_up=1.0)
        f = steps / progress
        lost_per_cycle = (1 - a) * lost_if_trained + a * lost_if_pending
        for r, seconds in zip(recoveries, read, strict=True):
            bad["restore"] += f * r.share * seconds
            for cause, value in r.badput.items():
                bad[cause] += f * r.share * value
            first_steps += f * r.share * r.first_steps
        bad["wasted_progress"] = f * lost_per_cycle * costs.step_s
        bad["other"] += f * lost_per_cycle * costs.step_gap_s
    productive = steps * costs.step_s + async_slowdown + first_steps * costs.first_step_extra_s
    wall = productive + sum(bad.values())
    return Outcome(wall, productive, steps * costs.step_s, f, bad, gave_up=give_up_chance(f, steps, budget))


def simulate(
    costs: Costs,
    failures: Failures,
    periods: Periods,
    steps: int,
    mode: str,
    *,
    seed: int = 0,
    trials: int = 100,
    budget: RetryBudget | None = None,
) -> Outcome:
    """Monte Carlo of the same phases, step by step, averaged over `trials` runs (an exact replay of the
    failure rule, for checking the closed form where failures are frequent). With a `budget`, a run the
    retry budget ends stops there (its share is `gave_up`); without one, every run goes to the end."""
    closed = expected(costs, failures, periods, steps, mode, budget or DEFAULT_BUDGET)
    if closed.failures > 20_000:  # a run that (almost) never finishes: too long to replay, and hopeless
        return closed
    trials = max(1, min(trials, int(2e6 // (steps + 10 * closed.failures))))  # bounded work
    rng = random.Random(seed)
    periods = clamp(periods, steps)
    runs = [
        _one_run(costs, failures, periods, steps, mode, rng, _poisson(rng, failures.rate_s), budget)
        for _ in range(trials)
    ]
    bad = {c: sum(r.badput_s.get(c, 0.0) for r in runs) / trials for c in runs[0].badput_s}
    return Outcome(
        sum(r.wall_s for r in runs) / trials,
        sum(r.productive_s for r in runs) / trials,
        steps * costs.step_s,
        sum(r.failures for r in runs) / trials,
        bad,
        gave_up=sum(r.gave_up for r in runs) / trials,
    )


def replay(
    costs: Costs,
    failures: Failures,
    periods: Periods,
    steps: int,
    mode: str,
    failure_times: list[float],
    seed: int = 0,
    budget: RetryBudget | None = None,
) -> Outcome:
    """One run with failures at the given times (seconds of training wall time, from the first step);
    `seed` only picks the kind of each failure by `failures.process_kill_share`; with a `budget`, the run
    ends where the trainer would give up (`gave_up` 1)."""
    rng = random.Random(seed)
    return _one_run(costs, failures, periods, steps, mode, rng, iter(sorted(failure_times)), budget)


def _poisson(rng: random.Random, rate: float):
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        yield t


def _one_run(
    costs: Costs, failures: Failures, periods: Periods, steps: int, mode: str, rng, arrivals, budget=None
) -> Outcome:
    bad = dict.fromkeys(("startup_compile", "checkpoint_save", "restore", "wasted_progress"), 0.0)
    bad |= {"waiting_for_slices": 0.0, "other": costs.tail_s}
    bad["startup_compile"] = costs.startup_s
    t = 0.0  # training wall time (failures start with training, as fault_schedule's rate= does)
    next_failure = next(arrivals, math.inf)
    done, productive, count, first = 0, 0.0, 0, True
    furthest, marks, gave_up = 0, [], 0.0
    cost = {tier: save_cost(costs, tier, periods.of(tier)) if periods.of(tier) else 0.0 for tier in TIERS}
    step_time: dict[int, float] = {}  # time of each step on the current trajectory (rewound ones are waste)
    recoveries = _recoveries(costs, failures, mode)
    reads = _reads(costs)
    while done < steps:
        s = costs.step_s + (costs.first_step_extra_s if first else 0.0)
        k = done + 1
        if periods.snapshot and k % periods.snapshot == 0:
            s += cost["snapshot"]
        if periods.local and k % periods.local == 0 and k % periods.checkpoint and k != steps:
            s += cost["local"]
        t += s + costs.step_gap_s
        bad["other"] += costs.step_gap_s
        if k % periods.checkpoint == 0 or k == steps:
            t += cost["checkpoint"]
            bad["checkpoint_save"] += cost["checkpoint"]
        step_time[k] = s
        done, first = k, False
        furthest = max(furthest, done)
        if t < next_failure or done == steps:
            continue
        # The failure is noticed at this boundary; everything after the restored step is rewound.
        count += 1
        marks.append(furthest)
        if budget is not None and budget.exhausted(marks, furthest):
            gave_up = 1.0
            break
        while next_failure <= t:  # every failure due by this boundary is this one recovery
            next_failure = next(arrivals, math.inf)
        r = rng.choices(recoveries, weights=[r.share for r in recoveries])[0]
        back, source = restore_point(done, periods, r.tiers)
        for j in range(back + 1, done + 1):
            bad["wasted_progress"] += step_time.pop(j)
        recovery = dict(r.badput)
        recovery["restore"] = recovery.get("restore", 0.0) + reads[source]
        for cause, seconds in recovery.items():
            bad[cause] += seconds
        extra_first = (r.first_steps - 1) * costs.first_step_extra_s
        t += sum(recovery.values()) + extra_first
        productive += extra_first
        done, first = back, True  # a failure that fell in the recovery kills its first step
    productive += sum(step_time.values())
    wall = costs.startup_s + t + costs.tail_s
    return Outcome(wall, productive, steps * costs.step_s, count, bad, gave_up=gave_up)


def young_daly_steps(save_s: float, mtbf_s: float, step_s: float) -> float:
    """The first-order optimal save interval sqrt(2 x save cost x MTBF), in steps."""
    return math.sqrt(2 * save_s * mtbf_s) / step_s


def tiers_used(mode: str, available: tuple[str, ...]) -> tuple[str, ...]:
    """The available tiers worth saving in `mode`: host snapshots only help a process that survives."""
    return tuple(t for t in available if t == "checkpoint" or (t == "local" or mode != "full_restart"))


def recommend(
    costs: Costs,
    failures: Failures,
    steps: int,
    mode: str,
    *,
    available: tuple[str, ...] = ("checkpoint",),
    budget: RetryBudget = DEFAULT_BUDGET,
    fixed: dict[str, int] | None = None,
) -> tuple[Periods, Outcome]:
    """The periods that minimise the expected wall time (coordinate search over a geometric grid, started
    from each tier's Young/Daly interval), and their outcome.

    Only the failures the model knows are weighed: with host snapshots covering every slice failure and
    no process kills, the persistent tier's best period is the whole run (its final save alone). Give a
    `process_kill_share` for the failures that need it. `fixed`: tiers whose period is given (the user's
    number), kept as they are while the others are searched."""
    fixed = fixed or {}
    tiers = tuple(t for t in tiers_used(mode, available) if t not in fixed)
    grid = sorted({max(1, round(steps ** (i / 48))) for i in range(49)})
    rate = failures.rate_s

    def young_daly(tier):
        blocked = getattr(costs, f"{tier}_save_s")
        return max(1, round(young_daly_steps(blocked, 1 / rate, costs.step_s))) if rate > 0 else steps

    start = {t: min(young_daly(t), steps) for t in tiers}
    periods = Periods(**{t: start.get(t, fixed.get(t, 0)) for t in TIERS})

    def wall(p):
        return expected(costs, failures, p, steps, mode).wall_s

    best = wall(periods)
    for _ in range(3):
        improved = False
        for tier in tiers:
            for value in grid + [start[tier]]:
                candidate = dataclasses.replace(periods, **{tier: value})
                w = wall(candidate)
                if w < best - 1e-9:
                    periods, best, improved = candidate, w, True
        if not improved:
            break
    if periods.local >= steps and "local" not in fixed:  # not worth saving locally at all
        periods = dataclasses.replace(periods, local=0)
    return periods, expected(costs, failures, periods, steps, mode, budget)


def sdc_check_period(step_s: float, check_s: float, bad_chip_rate_s: float, *, max_overhead: float = 0.05) -> int:
    """The `sdc_check_period` that loses the least time to silent data corruption (0: no rate, no checks).

    A check costs `check_s` (trainer.attempt.sdc: two forward and backward passes). A chip that starts
    computing wrong numbers (at `bad_chip_rate_s` over the cluster) corrupts every step until the next
    check sees it, and the run rolls back those steps: half a period on average. Per second of training
    that is check_s / (N step_s) + rate N step_s / 2, least at N = sqrt(2 check_s / rate) / step_s; never
    so short that the checks cost more than `max_overhead` of the step time."""
    if bad_chip_rate_s <= 0 or step_s <= 0:
        return 0
    best = math.sqrt(2.0 * check_s / bad_chip_rate_s) / step_s
    return max(1, math.ceil(check_s / (max_overhead * step_s)), round(best))


def sdc_check_cost(step_s: float, check_s: float, period: int, bad_chip_rate_s: float) -> tuple[float, float]:
    """(share of step time the checks cost, share lost to steps rolled back after a bad chip) at `period`."""
    if period <= 0:
        return 0.0, 0.0
    return check_s / (period * step_s), bad_chip_rate_s * period * step_s / 2.0
