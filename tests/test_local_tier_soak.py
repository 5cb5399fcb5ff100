"""Soak: kill -9 one process at random moments and at saves, local period 5, persistent period 50.

Each restart must resume from the newest local step committed when the process died (never more than 5
steps lost, as its `restart_resumed` event counts them), and the run must end bitwise equal to an
uninterrupted one, with the same batch at every step. The moments come from a seeded generator: random
points in the step stream, right as a local save starts, and while the persistent save of step 50 is in
flight. With local_checkpoint_wait_for_write=true the loop waits for a local write one step after
starting it, so the 5-step bound holds however long the write takes.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_harness import assert_same_data_order, assert_same_params, cli_env, command, run_cli

from trainer.checkpoint import local_store
from trainer.checkpoint.commit import committed_steps
from trainer.io.jsonl import read_jsonl as _read_jsonl

STEPS = 100
LOCAL_PERIOD, PERSISTENT_PERIOD = 5, 50
MOMENTS = ["local_save", "random", "random", "local_save", "persistent_save", "random", "local_save", "random"]


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def _events_since(run: Path, t0: float) -> list[dict]:
    return [e for e in _read_jsonl(run / "events.jsonl") if e.get("time", 0) >= t0]


def _trigger(kind: str, rng: random.Random, run: Path, t0: float):
    """A predicate over the run's files: true at the moment to kill. Each moment comes after at least one
    local save of this process committed, so the run moves on between kills."""
    if kind == "random":
        steps = rng.randint(LOCAL_PERIOD + 1, 3 * LOCAL_PERIOD)

        def ready():
            return sum(r.get("time", 0) >= t0 for r in _read_jsonl(run / "metrics.jsonl")) >= steps

        return ready
    if kind == "local_save":

        def at_local_save():  # the second local save of this process has just started
            return sum(e["event"] == "local_checkpoint_save_start" for e in _events_since(run, t0)) >= 2

        return at_local_save

    def at_persistent_save():  # Orbax is writing step 50: its temporary directory exists
        prefix = f"{PERSISTENT_PERIOD}."
        return any(n.startswith(prefix) and ".orbax-checkpoint-tmp" in n for n in _names(run / "checkpoints"))

    return at_persistent_save


@pytest.mark.soak
@pytest.mark.timeout(1800)
def test_random_kill_9_with_the_local_tier_loses_at_most_5_steps_and_ends_bitwise(tmp_path):
    tier = [
        f"local_checkpoint_directory={tmp_path / 'node_local'}",
        f"local_checkpoint_period={LOCAL_PERIOD}",
        "local_checkpoint_wait_for_write=true",  # the hard bound: a lost process loses at most the period
        f"checkpoint_period={PERSISTENT_PERIOD}",
        f"steps={STEPS}",
        "num_slices=1",
        f"jax_cache_dir={tmp_path / 'jax_cache'}",
    ]
    base = run_cli(tmp_path, "base", *tier, devices=1)
    assert base.returncode == 0, base.stderr[-3000:]
    run, local_dir = tmp_path / "soak", tmp_path / "node_local" / "soak"
    rng = random.Random(20261201)
    kills = []
    for kind in MOMENTS:
        t0 = time.time()
        proc = subprocess.Popen(
            command(tmp_path, "soak", *tier), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(1)
        )
        ready, deadline = _trigger(kind, rng, run, t0), time.time() + 300  # a hang guard
        while proc.poll() is None and time.time() < deadline and not ready():
            time.sleep(0.001)
        if proc.poll() is not None:  # finished before the moment came (e.g. step 50 already passed)
            break
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        left, checkpoints = _names(local_dir), _names(run / "checkpoints")
        kills.append(
            {
                "kind": kind,
                "local": (local_store.committed_steps(local_dir) or [None])[-1],
                "persistent": (committed_steps(run / "checkpoints") or [None])[-1],
                "persistent_in_flight": any(".orbax-checkpoint-tmp" in n for n in checkpoints),
                "local_partial": any(".partial-" in n for n in left),
                "time": time.time(),
            }
        )
    final = run_cli(tmp_path, "soak", *tier, devices=1, timeout=600)
    assert final.returncode == 0, final.stderr[-3000:]
    assert len(kills) >= 6, kills
    assert any(k["kind"] == "persistent_save" and k["persistent_in_flight"] for k in kills), kills

    resumed = [e for e in _read_jsonl(run / "events.jsonl") if e["event"] == "restart_resumed"]
    assert len(resumed) >= len(kills)  # the k-th restart follows the k-th kill
    for kill, event in zip(kills, resumed):
        newest = max(s for s in (kill["local"], kill["persistent"], 0) if s is not None)
        expected = "init" if newest == 0 else f"local:{newest}"
        if kill["persistent"] is not None and kill["persistent"] > (kill["local"] or 0):
            expected = f"checkpoint:{newest}"
        assert event["source"] == expected, (kill, event)
        assert event["steps_lost"] <= LOCAL_PERIOD, (kill, event)
    evs = _read_jsonl(run / "events.jsonl")
    partial_removed = [e for e in evs if e["event"] == "local_checkpoint_partial_removed"]
    assert len(partial_removed) == sum(k["local_partial"] for k in kills)
    assert_same_data_order(run, tmp_path / "base", STEPS)
    assert_same_params(run, tmp_path / "base")
