"""The train loop ends at a step boundary with an Outcome (never by raising through itself), and the
between-steps bookkeeping acts only on what it is given."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.attempt.builder import Attempt
from trainer.attempt.loop import train_loop
from trainer.attempt.nonfinite import NonFiniteError, NonFinitePolicy
from trainer.attempt.outcome import Finished, Preempted, Rollback, ScaleUp
from trainer.checkpoint import NoCheckpoints
from trainer.data.batch import BATCH_KEYS
from trainer.elastic.boundary import RecoveryStats, StepBoundary
from trainer.elastic.periods import FixedPeriods
from trainer.program.layout import BatchLayout


class _Events:
    def __init__(self):
        self.log = []

    def emit(self, name, **fields):
        self.log.append((name, fields))

    def named(self, name):
        return [f for n, f in self.log if n == name]


class _Sinks:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


class _Batches:
    """Batch i is filled with i; the iterator state is how many batches it has yielded."""

    def __init__(self, start=0):
        self.yielded = start

    def __next__(self):
        self.yielded += 1
        return {k: np.full((2, 4), self.yielded, np.int32) for k in BATCH_KEYS}

    def get_state(self):
        return {"yielded": self.yielded}


def _attempt(nan_at=(), start=0):
    """An attempt whose 'step' adds one and reports the batch's value as the loss (non-finite at nan_at)."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

    def step_fn(state, batch):
        value = batch["inputs"][0, 0]
        finite = int(value) not in nan_at
        metrics = {
            "loss": jnp.float32(value) if finite else jnp.float32(jnp.nan),
            "learning_rate": jnp.float32(0.1),
            "grad_norm": jnp.float32(1.0),
            "tokens": jnp.float32(8),
            "z_loss": jnp.float32(0),
            "aux_loss": jnp.float32(0),
            "finite": jnp.bool_(finite),
        }
        return state + 1, metrics

    return Attempt(
        mesh=mesh,
        batch_layout=BatchLayout(2, 1, 1.0),
        state=jnp.int32(start),
        start_step=start,
        restored_from="init",
        step_fn=step_fn,
        batch_sharding=NamedSharding(mesh, PartitionSpec()),
        iterator=_Batches(start),
        checkpointer=NoCheckpoints(),
        flops_per_step=1.0,
        sequence_length=4,
        checkpoint_metadata={},
        stack=contextlib.ExitStack(),
    )


class _Boundary:
    def __init__(self, returning_at=None):
        self.returning_at, self.seen = returning_at, []

    def before_step(self, step):
        pass

    def after_step(self, step, state, data_state):
        self.seen.append((step, data_state()["yielded"]))
        return [1] if step == self.returning_at else []


def _run(attempt, *, steps=5, policy="rollback", boundary=None, stop_after=None):
    sinks, events = _Sinks(), _Events()
    nonfinite = NonFinitePolicy(policy, events)
    outcome = train_loop(
        attempt,
        steps=steps,
        sinks=sinks,
        events=events,
        nonfinite=nonfinite,
        boundary=boundary,
        stop_requested=lambda step: stop_after is not None and int(attempt.iterator.yielded) >= stop_after,
    )
    return outcome, sinks.records, nonfinite, events


def test_a_run_to_the_end_finishes_with_one_record_per_step_the_last_marked():
    outcome, records, _, _ = _run(_attempt())
    assert outcome == Finished(5)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5] and records[-1]["last"] is True


def test_a_non_finite_step_ends_the_loop_with_a_rollback_and_its_batch_is_skipped_next_time():
    outcome, records, nonfinite, events = _run(_attempt(nan_at={3}))
    assert outcome == Rollback(3)
    assert [r["step"] for r in records] == [1, 2, 3], "the step's record is written once"
    assert nonfinite.skips(3) and not nonfinite.skips(4)
    assert [f["step"] for f in events.named("nonfinite_step")] == [3]
    # The retry from step 2 skips batch 3: steps 3..5 train on batches 4..6, all finite.
    retry = _attempt(nan_at={3}, start=2)
    sinks = _Sinks()
    again = train_loop(retry, steps=5, sinks=sinks, events=_Events(), nonfinite=nonfinite)
    assert isinstance(again, Finished)
    assert [(r["step"], r["loss"]) for r in sinks.records] == [(3, 4.0), (4, 5.0), (5, 6.0)]


def test_a_second_non_finite_result_at_a_rolled_back_step_stops_the_run():
    nonfinite = NonFinitePolicy("rollback", _Events())
    nonfinite.rolled_back.add(3)
    with pytest.raises(NonFiniteError, match="step 3"):
        train_loop(_attempt(nan_at={4}, start=2), steps=5, sinks=_Sinks(), events=_Events(), nonfinite=nonfinite)


def test_returning_slices_end_the_loop_with_a_scale_up_that_carries_the_live_state():
    boundary = _Boundary(returning_at=2)
    attempt = _attempt()
    outcome, records, _, _ = _run(attempt, boundary=boundary)
    assert isinstance(outcome, ScaleUp) and (outcome.step, outcome.returning) == (2, (1,))
    assert int(outcome.state) == 2, "the state after step 2, for the supervisor's snapshot"
    assert attempt.iterator.get_state() == {"yielded": 2}, "the data state pairs with that step"
    assert [r["step"] for r in records] == [1, 2]
    assert boundary.seen == [(1, 1), (2, 2)]


def test_a_stop_request_ends_the_loop_preempted_after_the_step_in_hand():
    outcome, records, _, events = _run(_attempt(), stop_after=3)
    assert outcome == Preempted(3)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["last"] is True
    assert [f["step"] for f in events.named("preempted")] == [3]


class _Profiler:
    def __init__(self):
        self.after = []

    def before_step(self, step):
        pass

    def after_step(self, step, state=None):
        self.after.append(step)


class _Snapshots:
    def __init__(self):
        self.taken = []

    def take(self, step, state, data_state, *, block=False, persist=False):
        self.taken.append((step, data_state) + (("persist",) if persist else ()))

    def wait_for_copy(self):
        self.taken.append("settled")


def test_the_boundary_snapshots_on_its_period_ends_downtime_once_and_reports_returning_slices():
    stats = RecoveryStats(last_step=4, failed_at=100.0)
    events, snapshots, profiler = _Events(), _Snapshots(), _Profiler()
    answers = iter([[], [], [2]])
    boundary = StepBoundary(
        active=[0, 1],
        stats=stats,
        events=events,
        profiler=profiler,
        snapshots=snapshots,
        periods=FixedPeriods(snapshot=2),
        returning=lambda: next(answers),
        wall_time=lambda: 103.5,
    )
    got = [boundary.after_step(s, jnp.int32(s), lambda s=s: {"yielded": s}) for s in (3, 4, 5)]
    assert got == [[], [], [2]]
    assert snapshots.taken == [(4, {"yielded": 4})]
    assert profiler.after == [3, 4, 5] and stats.last_step == 5
    recovered = events.named("first_step_after_recovery")
    assert len(recovered) == 1 and recovered[0]["step"] == 3 and recovered[0]["seconds_since_detection"] == 3.5
    assert stats.downtime_s == 3.5 and stats.failed_at is None


def _snapshots_taken(steps: int, *, snapshot_period: int, local_checkpoint_period: int, **kw) -> list:
    """What a boundary with these periods asks of the snapshots over steps 1..steps."""
    snapshots = _Snapshots()
    boundary = StepBoundary(
        active=[0],
        stats=RecoveryStats(),
        events=_Events(),
        profiler=_Profiler(),
        snapshots=snapshots,
        periods=FixedPeriods(snapshot_period, local_checkpoint_period),
        **kw,
    )
    for s in range(1, steps + 1):
        boundary.after_step(s, jnp.int32(s), lambda s=s: {"yielded": s})
    return snapshots.taken


def test_the_boundary_writes_the_local_tier_on_its_own_period():
    taken = _snapshots_taken(6, snapshot_period=2, local_checkpoint_period=3, wait_for_local_write=True)
    assert taken == [
        (2, {"yielded": 2}),
        (3, {"yielded": 3}, "persist"),
        "settled",  # the local write of step 3 commits before step 4's record: at most 3 steps lost
        (4, {"yielded": 4}),
        (6, {"yielded": 6}, "persist"),
    ]


def test_without_waiting_for_local_writes_the_boundary_never_settles_them():
    taken = _snapshots_taken(4, snapshot_period=0, local_checkpoint_period=2, wait_for_local_write=False)
    assert taken == [(2, {"yielded": 2}, "persist"), (4, {"yielded": 4}, "persist")]
