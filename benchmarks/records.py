"""Benchmark records: every figure the docs quote, kept with the command, commit and machine that measured it.

A benchmark ends with `write_record(record_id, benchmark, argv, tables=..., figures=...)`, which writes
`benchmarks/records/<record_id>.json`: the command as run, the commit (refused when the modules it
measures have uncommitted changes: the figure must name the code it measured), the machine, the date,
the measured figures and markdown tables of them, and a digest of the modules the benchmark measures
(`MEASURES`). `python -m scripts.figures` renders the tables into README.md and docs/; the figures test
fails when a documented table has no record, differs from its record, or its record's digest no longer
matches the modules (the code changed since it was measured). Smoke runs (TRAINER_SMOKE=1) record nothing.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "records"


# What one trainer process runs: the program on the devices, the attempt around it, the process's signals
# and watchdog (each a package under trainer/).
_RUNTIME = ["trainer/program", "trainer/attempt", "trainer/process"]


def _runtime_imports(entry: str) -> list[str]:
    """`entry` and the modules of the `_RUNTIME` packages it imports, directly or through each other."""
    seen, todo, runtime = set(), [entry], tuple(f"{p}/" for p in _RUNTIME)
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for node in ast.walk(ast.parse((REPO / rel).read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            todo += [f"{n.replace('.', '/')}.py" for n in names if n.replace(".", "/").startswith(runtime)]
    return sorted(seen)


# What each benchmark measures: a change to any of these files makes its records stale. The model goes with
# trainer/config/rope_scaling.py, the `rope_scaling` grammar whose frequencies it computes.
_STEP = [
    *_RUNTIME,
    "trainer/model",
    "trainer/config/rope_scaling.py",
    "trainer/parallel",
    "trainer/config/schema.py",
    "configs",
]
# The compiled step alone (what the compile benchmarks read): the runtime modules that build it, not the
# loop, the attempt builder or recovery around it.
_PROGRAM = [
    *_runtime_imports("trainer/program/layout.py"),
    "trainer/model",
    "trainer/config/rope_scaling.py",
    "trainer/parallel",
    "trainer/config/schema.py",
    "configs",
]
# Saves and restores of both tiers: the local tier is the host snapshot (snapshot.py, pinned_snapshots.py)
# written by trainer/checkpoint/local_store.py when the step boundary (boundary.py) says it is due; the
# run's wiring (run.py, the process root, the backends) decides which tiers a run has.
_SAVES = [
    "trainer/checkpoint",
    *_RUNTIME,
    "trainer/elastic/snapshot.py",
    "trainer/elastic/pinned_snapshots.py",
    "trainer/elastic/boundary.py",
    "trainer/elastic/backends",
    "trainer/run.py",
    "trainer/process_root.py",
    "trainer/config/schema.py",
    "configs",
]
MEASURES = {
    "attention_memory": [*_PROGRAM, "benchmarks/attention_memory.py"],
    "checkpoint_overhead": [*_SAVES, "benchmarks/checkpoint_overhead.py"],
    "process_loss": [*_SAVES, "benchmarks/process_loss.py"],
    # The schema holds the data pipeline's defaults (packing, shuffle seed) the benchmark runs with.
    "mixture_proportions": ["trainer/data", "trainer/config/schema.py", "benchmarks/mixture_proportions.py"],
    # hostmem.py: whether the host malloc is on huge pages (`--hugepages`), which moves steps and start-up.
    "train_throughput": [
        *_STEP,
        "trainer/data/synthetic.py",
        "trainer/elastic/backends",
        "trainer/run.py",
        "trainer/process_root.py",
        "trainer/hostmem.py",
        "benchmarks/train_throughput.py",
        "benchmarks/maxtext_cpu.py",
    ],
    "compile_presets": [*_PROGRAM, "trainer/aot", "trainer/compile.py", "benchmarks/compile_presets.py"],
    "compile_vs_maxtext": [*_PROGRAM, "trainer/aot", "trainer/compile.py", "benchmarks/compile_vs_maxtext.py"],
    "long_context_compile": [
        *_PROGRAM,
        "trainer/aot",
        "trainer/compile.py",
        "benchmarks/long_context_compile.py",
    ],
    "elastic_recovery": [
        "trainer/elastic",
        "trainer/failures",
        *_RUNTIME,
        "trainer/checkpoint",
        "trainer/run.py",
        "trainer/process_root.py",
        "trainer/observe",
        "trainer/hostmem.py",
        "benchmarks/elastic_recovery.py",
    ],
    "elastic_soak": [
        "trainer/elastic",
        "trainer/failures",
        *_RUNTIME,
        "trainer/checkpoint",
        "trainer/run.py",
        "trainer/process_root.py",
        "trainer/plan",
        "trainer/observe",
        "benchmarks/elastic_soak.py",
    ],
    # The planner's prediction (trainer/plan) from the costs of a real elastic run with injected failures
    # (trainer/failures draws them), and the goodput the report measures in it (trainer/observe).
    # The losses of clean runs on real text: the step (model, optimizer, schedule), the data pipeline and
    # the defaults; the detector is off in these runs (its judgement is recomputed offline).
    "spike_false_positives": [
        *_RUNTIME,
        "trainer/model",
        "trainer/config/rope_scaling.py",
        "trainer/data",
        "trainer/config/schema.py",
        "configs",
        "benchmarks/spike_false_positives.py",
        "benchmarks/corpus.py",
    ],
    "goodput_planner": [
        "trainer/plan",
        "trainer/elastic",
        *_RUNTIME,
        "trainer/checkpoint",
        "trainer/observe",
        "trainer/run.py",
        "trainer/process_root.py",
        "trainer/config/schema.py",
        "trainer/failures",
        "configs",
        "benchmarks/goodput_planner.py",
    ],
    # The loss curve of a run on real text against MaxText's: what decides this trainer's numbers (the model,
    # the step and optimizer, the data pipeline and tokenizer) and the MaxText side's scripts. Every
    # hyperparameter is passed explicitly, so the schema's defaults are not measured.
    "loss_parity": [
        "trainer/model",
        "trainer/config/rope_scaling.py",
        "trainer/program/step.py",
        "trainer/program/optim.py",
        "trainer/data",
        "configs/models",
        "benchmarks/loss_parity.py",
        "benchmarks/maxtext_side.py",
        "benchmarks/maxtext_cpu.py",
        "benchmarks/corpus.py",
    ],
    # The losses of real-text runs through failures against the uninterrupted run's: the step, the data
    # pipeline (its iterator state), the elastic recovery, the checkpoints and the fault injection.
    "curves_through_failures": [
        *_RUNTIME,
        "trainer/model",
        "trainer/config/rope_scaling.py",
        "trainer/parallel",
        "trainer/data",
        "trainer/elastic",
        "trainer/checkpoint",
        "trainer/failures",
        "trainer/run.py",
        "trainer/process_root.py",
        "trainer/config/schema.py",
        "configs",
        "benchmarks/curves_through_failures.py",
        "benchmarks/corpus.py",
    ],
    # LoRA against full fine-tuning: the step (model, LoRA, optimizer), the SFT data pipeline, the saves and
    # restores, the CLI runs around them, and the ahead-of-time compile for a TPU topology.
    "lora_vs_full": [
        *_SAVES,
        "trainer/model",
        "trainer/config/rope_scaling.py",
        "trainer/parallel",
        "trainer/data",
        "trainer/aot",
        "trainer/compile.py",
        "benchmarks/lora_vs_full.py",
    ],
    # Data preparation's tokens/s with 1 and N worker processes on the real-text corpus: the readers, the
    # tokenizer, the work units and the merge (trainer/data), the paths and outputs (trainer/io).
    "prepare_throughput": [
        "trainer/data",
        "trainer/io",
        "benchmarks/prepare_throughput.py",
        "benchmarks/corpus.py",
    ],
}


def _files(paths: list[str]) -> list[Path]:
    out = []
    for rel in paths:
        p = REPO / rel
        out += sorted(f for f in p.rglob("*") if f.suffix in (".py", ".yml")) if p.is_dir() else [p]
    return out


def digest(benchmark: str) -> str:
    """sha256 over the measured modules' paths and contents."""
    h = hashlib.sha256()
    for f in _files(MEASURES[benchmark]):
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _machine() -> dict:
    import jax

    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 0
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(pages / (1 << 30)),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def package_versions(python: str, *packages: str) -> list[str]:
    """The installed versions of `packages` in another interpreter (one that runs a peer, MaxText, or
    this trainer under a different jax), as the record names what measured it."""
    code = f"import importlib.metadata as m; print(*(m.version(p) for p in {list(packages)!r}))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def write_record(
    record_id: str, benchmark: str, argv: list[str], *, tables: dict[str, str], figures
) -> Path | None:
    """Write benchmarks/records/<record_id>.json; nothing in smoke mode. Returns the path written."""
    if os.environ.get("TRAINER_SMOKE", "") not in ("", "0"):
        print("smoke run: no record written", file=sys.stderr)
        return None
    dirty = _git("status", "--porcelain", "--", *MEASURES[benchmark])
    if dirty:
        raise SystemExit(
            f"not recording {record_id}: the modules it measures have uncommitted changes:\n{dirty}\n"
            "commit them first, so the record names the code it measured"
        )
    record = {
        "record": record_id,
        "benchmark": benchmark,
        "command": shlex.join(["python", f"benchmarks/{benchmark}.py", *argv]),
        "commit": _git("rev-parse", "HEAD"),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "machine": _machine(),
        "modules": MEASURES[benchmark],
        "digest": digest(benchmark),
        "tables": tables,
        "figures": figures,
    }
    RECORDS.mkdir(parents=True, exist_ok=True)
    path = RECORDS / f"{record_id}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record written: {path.relative_to(REPO)}", file=sys.stderr)
    return path


def load(record_id: str) -> dict:
    return json.loads((RECORDS / f"{record_id}.json").read_text())


def redeclare(record_id: str) -> Path:
    """Give a record the modules its benchmark now declares (MEASURES narrowed or widened), without
    re-measuring: allowed only when every file it now declares is committed and unchanged since the
    record's commit, so the record still names the code it measured. Otherwise: re-run the benchmark."""
    record = load(record_id)
    paths = MEASURES[record["benchmark"]]
    dirty = _git("status", "--porcelain", "--", *paths)
    changed = _git("diff", "--name-only", record["commit"], "HEAD", "--", *paths)
    if dirty or changed:
        raise SystemExit(
            f"{record_id}: the modules its benchmark measures changed since {record['commit'][:10]}:\n"
            f"{dirty or changed}\nre-run `{record['command']}` instead"
        )
    record["modules"], record["digest"] = paths, digest(record["benchmark"])
    path = RECORDS / f"{record_id}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


if __name__ == "__main__":
    # python benchmarks/records.py redeclare RECORD_ID...
    if len(sys.argv) < 3 or sys.argv[1] != "redeclare":
        raise SystemExit("usage: python benchmarks/records.py redeclare RECORD_ID...")
    for rid in sys.argv[2:]:
        print(f"redeclared: {redeclare(rid).relative_to(REPO)}")
