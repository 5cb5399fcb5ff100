"""Shared by the benchmarks: run the trainer CLI in a subprocess and read what it wrote.

Smoke mode: with TRAINER_SMOKE=1 in the environment a benchmark runs its whole path (the same CLI runs,
measurements and report) at minimal sizes (few steps, short sequences), whatever its arguments say, so
that every documented command can be checked quickly. Its figures then mean nothing, and a benchmark
says so on its first line (`announce_smoke`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from trainer.observe import catalogue

SMOKE_VAR = "TRAINER_SMOKE"
# Trainer arguments every smoke run caps: a narrow 2-layer model with a 512-token vocabulary (the synthetic
# data's, which the benchmarks train on) on short rows, so that steps, saves and restores cost little next to
# starting a process.
SMOKE_SHAPE = {
    "base_num_decoder_layers": 2,
    "base_emb_dim": 64,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 2,
    "head_dim": 16,
    "base_mlp_dim": 128,
    "vocab_size": 512,
    "max_target_length": 32,
}
SMOKE_SHAPE_TEXT = "a 2-layer 64-wide model, vocabulary 512, rows of 32 tokens, compiled without XLA optimisation"
# XLA compiles in half the time without its optimisation passes: compiling is most of a smoke run.
SMOKE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def smoke() -> bool:
    """Whether TRAINER_SMOKE is set (to anything but empty or 0)."""
    return os.environ.get(SMOKE_VAR, "") not in ("", "0")


def smoke_cap(value, cap):
    """`value`, at most `cap` in smoke mode."""
    return min(value, cap) if smoke() else value


def smoke_overrides(overrides: list[str], **caps) -> list[str]:
    """Trainer `key=value` arguments with, in smoke mode, each key of `caps` at most its cap: a given value
    above it is replaced in place, a missing key is added with the cap (every default is larger)."""
    if not smoke():
        return list(overrides)
    out, seen = [], set()
    for arg in overrides:
        key, sep, value = arg.partition("=")
        if sep and key in caps:
            seen.add(key)
            try:
                arg = f"{key}={min(int(value), caps[key])}"
            except ValueError:
                arg = f"{key}={caps[key]}"
        out.append(arg)
    return out + [f"{k}={v}" for k, v in caps.items() if k not in seen]


def announce_smoke(shortened: str) -> None:
    """In smoke mode, say so (and what was shortened) on one line before anything else."""
    if smoke():
        print(f"smoke mode ({SMOKE_VAR}=1): {shortened}; figures are not measurements", flush=True)


def smoke_env(env: dict) -> dict:
    """`env` (changed in place) with, in smoke mode, XLA's optimisation passes off in XLA_FLAGS."""
    if smoke():
        flags = env.get("XLA_FLAGS", "").split()
        given = {f.split("=")[0] for f in flags}
        env["XLA_FLAGS"] = " ".join(flags + [f for f in SMOKE_XLA_FLAGS if f.split("=")[0] not in given])
    return env


def smoke_median(xs):
    """median(xs), or in smoke mode None when there is nothing to take it of (a run that short may end
    before a save or snapshot has a step after it)."""
    return None if smoke() and not xs else median(xs)


HUGEPAGES = ("on", "off")
_HUGETLB = "glibc.malloc.hugetlb="


def hugepage_env(env: dict, setting: str) -> dict:
    """`env` (changed in place) for a trainer whose host malloc is on huge pages or not (trainer/hostmem.py).
    `off`: TRAINER_HUGEPAGE_MALLOC=0 and glibc.malloc.hugetlb=0 in GLIBC_TUNABLES, since a tunable already
    there (the container image sets it to 1) wins over the opt-out; `on`: neither, so the CLI turns it on."""
    if setting not in HUGEPAGES:
        raise ValueError(f"huge pages {setting!r}: expected one of {HUGEPAGES}")
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and not t.startswith(_HUGETLB)]
    if setting == "off":
        env["TRAINER_HUGEPAGE_MALLOC"] = "0"
        tunables.append(f"{_HUGETLB}0")
    else:
        env.pop("TRAINER_HUGEPAGE_MALLOC", None)
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    else:
        env.pop("GLIBC_TUNABLES", None)
    return env


def check_hugepages(run_dir: Path, setting: str) -> None:
    """Exit unless every process of the run started with huge pages `setting` (its `start` event says; on
    needs glibc >= 2.35 and transparent huge pages not `never`); in smoke mode only warn."""
    want = setting == "on"
    starts = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == catalogue.START]
    found = [e.get("host_hugepages") for e in starts]
    if found and all(x is want for x in found):
        return
    message = f"{run_dir.name}: asked for huge pages {setting}, the trainer's start events say {found}"
    if not smoke():
        sys.exit(f"{message}: this machine cannot compare the settings (see trainer/hostmem.py)")
    print(f"{message} (smoke run: no matter)", file=sys.stderr)


def env_with_devices(devices: int) -> dict:
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    return smoke_env(env)


def trainer_cmd(root: Path, name: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        *overrides,
        f"base_output_directory={root}",
        f"run_name={name}",
        "enable_tensorboard=false",
    ]


def run(root: Path, name: str, overrides: list[str], devices: int = 1) -> Path:
    proc = subprocess.run(
        trainer_cmd(root, name, overrides), capture_output=True, text=True, env=env_with_devices(devices)
    )
    if proc.returncode != 0:
        sys.exit(f"trainer run {name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return root / name


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def step_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's per-step rows (eval rows, written when eval_interval is set, left out)."""
    from trainer.observe.records import step_rows

    return step_rows(read_jsonl(run_dir / "metrics.jsonl"))


def step_times(run_dir: Path, skip: int = 3) -> list[float]:
    return [r["step_time_s"] for r in step_records(run_dir)[skip:]]


def median(xs) -> float:
    return statistics.median(xs)


def mean(xs) -> float:
    return statistics.fmean(xs)


def excess_step_time(
    run_dir: Path, start_event: str, end_event: str, *, skip: int = 3, not_with: str | None = None
) -> tuple[list[float], float]:
    """(extra step time each periodic job cost, baseline step time), measured inside one run.

    A job (a checkpoint save, a snapshot) starts at step s (`start_event` with that step) and ends when
    `end_event` of the same step is emitted. The steps it can slow are s up to the first step that
    completed after it ended, plus one; its cost is their step time above the median of every other
    step. Comparing one run against another instead would drown a 1% effect in the few-percent
    run-to-run noise of a shared machine. Jobs with no step after them (the final save) are left out,
    and so are those starting at a step where a `not_with` event (another job) started too.
    """
    records = step_records(run_dir)
    times = {r["step"]: r["step_time_s"] for r in records[skip:]}  # the last record of a replayed step wins
    done_at = {r["step"]: r["time"] for r in records[skip:]}
    events = read_jsonl(run_dir / "events.jsonl")
    ends = {e["step"]: e["time"] for e in events if e["event"] == end_event}
    busy = {e.get("step") for e in events if not_with is not None and e["event"] == not_with}
    windows = []
    for e in events:
        s = e.get("step")
        if e["event"] != start_event or s not in ends or s not in times or s in busy:
            continue
        after = [t for t in sorted(times) if t >= s and done_at[t] >= ends[s]]
        if not after or after[0] + 1 not in times:
            continue
        windows.append(range(s, after[0] + 2))
    inside = {t for w in windows for t in w}
    outside = [v for t, v in times.items() if t not in inside]
    # A run so short that every step is near a job (smoke mode) has no baseline of its own: use them all.
    base = median(outside or list(times.values()))
    return [sum(times[t] - base for t in w) for w in windows], base
