"""The goodput account fed one record at a time (`GoodputAccount`, what a live run's metrics endpoint
keeps) equals the account of the same records written out as a formula over the whole lists, at every
point of randomly generated runs: rewinds after failures, loss-spike rollbacks, restores and waits,
blocked saves, compiles, evaluations, silent-data-corruption checks, hangs, a finish."""

from __future__ import annotations

import math
import random

import pytest

from trainer.observe import catalogue as ev
from trainer.observe.goodput import CAUSES, GoodputAccount, account
from trainer.observe.records import EVAL_KIND


def reference(events: list[dict], rows: list[dict], now: float | None) -> dict:
    """The account as a formula over the whole lists (the definition the streaming account must meet)."""
    evaluating = sum(r.get("eval_time_s") or 0.0 for r in rows if r.get("kind") == EVAL_KIND)
    steps = [r for r in rows if r.get("kind") != EVAL_KIND]
    if not events:
        return {"wall_s": 0.0, "productive_s": 0.0, "goodput": None, "badput_s": dict.fromkeys(CAUSES, 0.0)}
    t0 = events[0]["time"]
    finish = [e["time"] for e in events if e["event"] == ev.FINISH]
    everything = [e["time"] for e in events] + [r["time"] for r in rows]
    t1 = finish[-1] if finish else (now if now is not None else max(everything))
    wall = max(t1 - t0, 1e-9)
    newest = {r["step"]: i for i, r in enumerate(steps)}  # each step's last record is kept
    kept = set(newest.values())
    saving = sum(
        e.get("seconds", 0.0) - e.get("waited_for_step_s", 0.0)
        for e in events
        if e["event"] == ev.CHECKPOINT_SAVE_BLOCKED
    )
    productive = max(0.0, sum(r["step_time_s"] for i, r in enumerate(steps) if i in kept) - saving)
    undone = [r for i, r in enumerate(steps) if i not in kept]
    rollbacks = [e for e in events if e["event"] == ev.LOSS_SPIKE_ROLLBACK]
    rolled = sum(
        r["step_time_s"]
        for r in undone
        if any(e["restored_step"] < r["step"] <= e["step"] and r["time"] <= e["time"] for e in rollbacks)
    )
    first_attempt = next((e["time"] for e in events if e["event"] == ev.ATTEMPT_START), t1)

    def later_spans(start, end):
        out, opened = [], None
        for e in events:
            if e["event"] == start:
                opened = e["time"]
            elif e["event"] == end and opened is not None:
                out.append(e["time"] - opened)
                opened = None
        return sum(out[1:])

    bad = {
        "startup_compile": (first_attempt - t0)
        + sum(
            e.get("seconds", 0.0) for e in events if e["event"] == ev.COMPILE_DONE and e["time"] > first_attempt
        ),
        "checkpoint_save": saving,
        "restore": later_spans(ev.RESTORE_START, ev.RESTORE_END),
        "wasted_progress": sum(r["step_time_s"] for r in undone) - rolled,
        "waiting_for_slices": later_spans(ev.WAIT_START, ev.WAIT_END),
        "eval": evaluating,
        "sdc_check": sum(r.get("sdc_check_s") or 0.0 for r in steps)
        + sum(e.get("seconds", 0.0) for e in events if e["event"] == ev.SDC_DETECTED),
        "rollback": rolled,
        "hang": sum(e.get("seconds", 0.0) for e in events if e["event"] == ev.HANG_DETECTED),
    }
    bad["other"] = max(0.0, wall - productive - sum(bad.values()))
    return {"wall_s": wall, "productive_s": productive, "goodput": productive / wall, "badput_s": bad}


def random_run(seed: int) -> list[tuple[str, dict]]:
    """A run's records in the order they are written: ("event" | "row", record)."""
    rng = random.Random(seed)
    t, step, out = 1000.0, 0, []

    def event(name, **fields):
        nonlocal t
        t += rng.uniform(0.01, 2.0)
        out.append(("event", {"event": name, "time": t, **fields}))

    def row(**fields):
        nonlocal t
        t += rng.uniform(0.05, 1.0)
        out.append(("row", {"time": t, **fields}))

    event(ev.START)
    for attempt in range(rng.randint(1, 5)):
        if attempt or rng.random() < 0.5:
            event(ev.WAIT_START)
            event(ev.WAIT_END)
        event(ev.RESTORE_START)
        event(ev.RESTORE_END)
        if rng.random() < 0.2:
            event(ev.RESTORE_START)  # a start whose end was never written: dropped
        event(ev.ATTEMPT_START, attempt=attempt + 1)
        event(ev.COMPILE_DONE, seconds=rng.uniform(0.5, 5.0))
        for _ in range(rng.randint(3, 40)):
            step += 1
            row(
                step=step,
                step_time_s=rng.uniform(0.1, 1.0),
                sdc_check_s=rng.choice([None, 0.0, rng.uniform(0, 0.3)]),
            )
            roll = rng.random()
            if roll < 0.05:
                event(
                    ev.CHECKPOINT_SAVE_BLOCKED,
                    seconds=rng.uniform(0.1, 2.0),
                    waited_for_step_s=rng.uniform(0, 0.1),
                )
            elif roll < 0.08:
                row(kind=EVAL_KIND, step=step, eval_time_s=rng.uniform(0.1, 1.0))
            elif roll < 0.11 and step > 3:
                back = rng.randint(1, min(step - 1, 8))
                event(ev.LOSS_SPIKE_ROLLBACK, step=step, restored_step=step - back)
                step -= back
            elif roll < 0.12:
                event(ev.SDC_DETECTED, seconds=rng.uniform(0.1, 1.0))
        if rng.random() < 0.6 and step > 2:  # a failure: the next attempt rewinds
            event(ev.SLICE_DOWN_DETECTED)
            step -= rng.randint(0, min(step - 1, 10))
        if rng.random() < 0.1:
            event(ev.HANG_DETECTED, seconds=rng.uniform(1, 10))
    if rng.random() < 0.7:
        event(ev.FINISH)
    return out


def _close(a: dict, b: dict) -> None:
    for key in ("wall_s", "productive_s", "goodput"):
        assert (a[key] is None) == (b[key] is None)
        if a[key] is not None:
            assert math.isclose(a[key], b[key], rel_tol=1e-9, abs_tol=1e-9), key
    for cause in CAUSES:
        assert math.isclose(a["badput_s"][cause], b["badput_s"][cause], abs_tol=1e-4), cause


@pytest.mark.parametrize("seed", range(40))
def test_the_streaming_account_equals_the_whole_list_formula_at_every_point_of_a_run(seed):
    records = random_run(seed)
    acc, events, rows = GoodputAccount(), [], []
    for i, (kind, record) in enumerate(records):
        if kind == "event":
            acc.add_event(record)
            events.append(record)
        else:
            acc.add_row(record)
            rows.append(record)
        if i % 7 == 0 or i == len(records) - 1:
            now = record["time"] + 3.0
            _close(acc.result(now), reference(events, rows, now))
            _close(acc.result(), reference(events, rows, None))
    _close(account(events, rows), reference(events, rows, None))


def test_a_run_that_rewinds_counts_the_superseded_steps_as_wasted_and_a_rollbacks_as_rollback():
    def e(name, t, **f):
        return {"event": name, "time": t, **f}

    def r(step, t):
        return {"step": step, "time": t, "step_time_s": 1.0}

    events = [e(ev.START, 0.0), e(ev.ATTEMPT_START, 1.0), e(ev.LOSS_SPIKE_ROLLBACK, 7.5, step=6, restored_step=4)]
    rows = [r(s, float(s + 1)) for s in range(1, 7)] + [r(5, 8.0), r(6, 9.0)]  # 5 and 6 again after the rollback
    rows += [r(3, 10.0)]  # a failure rewound to step 2: step 3 again
    out = account(events, rows, now=10.0)
    assert out["productive_s"] == 6.0 and out["badput_s"]["rollback"] == 2.0
    assert out["badput_s"]["wasted_progress"] == 1.0


def test_memory_is_per_step_not_per_record():
    acc = GoodputAccount()
    acc.add_event({"event": ev.START, "time": 0.0})
    for step in range(1, 200_001):
        acc.add_row({"step": step, "time": float(step), "step_time_s": 0.5})
    assert acc._kept._rows.nbytes <= 16 * 2 * 200_001 and not acc._undone
    assert acc.result(now=200_001.0)["productive_s"] == 100_000.0
