"""The seed's job compiled for its target by this trainer and by MaxText, read by the same HLO parser.

    python benchmarks/compile_vs_maxtext.py --maxtext-python PY [--trainer-python PY]

The job: qwen3-0.6b on 3 slices of v5e-16 (48 chips), max_target_length=2048, per_device_batch_size 1 (the
reference run's) and 2 (the presets' default), each trainer's defaults otherwise. Both are compiled ahead
of time on this machine (libtpu, no TPU), each with its optimized HLO dumped (`XLA_FLAGS=--xla_dump_to`),
and both HLOs are read by `trainer/aot/hlo.py` (collectives per step and chip, ICI and DCN); memory is
each compiled step's arguments + temporaries. `--maxtext-python` is an interpreter with MaxText installed
(MaxText 0.2.5 needs Python >= 3.12); `--trainer-python` (default: this one) should have the same jax and
libtpu, so the same compiler builds both programs: the record names both versions. It writes the record
benchmarks/records/compile_vs_maxtext.json, rendered into docs/running_at_scale.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import REPO, package_versions, write_record  # noqa: E402

sys.path.insert(0, str(REPO))
from trainer.aot import hlo  # noqa: E402

TOPOLOGY, SLICES, CHIPS_PER_SLICE = "v5e-16", 3, 16
BATCHES = (1, 2)  # per_device_batch_size: the reference run's, and the presets' default


def _versions(python: str) -> str:
    jax_version, libtpu = package_versions(python, "jax", "libtpu")
    return f"jax {jax_version}, libtpu {libtpu}"


def _dumped_step(dump: Path) -> str:
    (path,) = [p for p in dump.glob("*jit_train_step*after_optimizations.txt")]
    return path.read_text()


def _run(argv: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """A command that must succeed (its stderr's tail and exit code stop the benchmark otherwise)."""
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(argv[:4])} ... exited {proc.returncode}")
    return proc


def _job(batch: int) -> list[str]:
    return [f"per_device_batch_size={batch}", "max_target_length=2048"]


def maxtext(python: str, work: Path, batch: int) -> dict:
    base = subprocess.run(
        [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", XLA_FLAGS=f"--xla_dump_to={work / 'dump'}")
    argv = [python, "-m", "maxtext.trainers.pre_train.train_compile", f"{base}/configs/base.yml"]
    argv += [
        f"compile_topology={TOPOLOGY}",
        f"compile_topology_num_slices={SLICES}",
        "model_name=qwen3-0.6b",
        *_job(batch),
    ]
    proc = _run(argv, env, work)
    stats = {k: int(v) for k, v in (kv.split("=") for kv in _memory_fields(proc.stdout + proc.stderr))}
    return {
        "memory": stats["argument_size_in_bytes"] + stats["temp_size_in_bytes"],
        "hlo": _dumped_step(work / "dump"),
        "versions": _versions(python),
    }


def _memory_fields(out: str) -> list[str]:
    """argument_size_in_bytes=..., temp_size_in_bytes=... from MaxText's printed CompiledMemoryStats."""
    line = next(x for x in out.splitlines() if "CompiledMemoryStats(" in x)
    return [f for f in line.replace(" ", "").split(",") if f.startswith(("argument_size", "temp_size"))]


def trainer(python: str, work: Path, batch: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={work / 'dump'}")
    argv = [python, "-m", "trainer.compile", "base.yml", "model=qwen3-0.6b", f"compile_topology={TOPOLOGY}"]
    argv += [f"compile_topology_num_slices={SLICES}", *_job(batch), "--json"]
    report = json.loads(_run(argv, env, REPO).stdout)
    (layout,) = report["layouts"]
    m = layout["memory"]
    return {
        "memory": m["arguments"] + m["temporaries"],
        "hlo": _dumped_step(work / "dump"),
        "versions": _versions(python),
    }


def figures(side: dict) -> dict:
    found = hlo.collectives(side["hlo"], devices_per_slice=CHIPS_PER_SLICE, num_slices=SLICES)
    summary = hlo.summarize(found)
    return {
        "versions": side["versions"],
        "memory_bytes": side["memory"],
        "collectives": summary,
        "ici_bytes": sum(v["bytes"] for v in summary.get("ici", {}).values()),
        "dcn_bytes": sum(v["bytes"] for v in summary.get("dcn", {}).values()),
        "largest": hlo.largest(found, 3),
    }


def _kinds(net: dict) -> str:
    return ", ".join(f"{k} {v['count']} ops {v['bytes'] / 1e9:.2f} GB" for k, v in sorted(net.items())) or "none"


def table(mt: dict, ours: dict, batch: int) -> str:
    def ratio(a, b):
        return f"{b / a:.2f}" if a else "—"

    rows = [
        f"| per chip, one step, per_device_batch_size={batch} | MaxText 0.2.5 (`train_compile`) | "
        "this trainer (`trainer.compile`) | ratio |",
        "|---|---|---|---|",
        f"| memory: arguments + temporaries | {mt['memory_bytes'] / 1e6:,.0f} MB | "
        f"{ours['memory_bytes'] / 1e6:,.0f} MB | {ratio(mt['memory_bytes'], ours['memory_bytes'])} |",
        f"| ICI collective buffers | {mt['ici_bytes'] / 1e9:.2f} GB | {ours['ici_bytes'] / 1e9:.2f} GB | "
        f"{ratio(mt['ici_bytes'], ours['ici_bytes'])} |",
        f"| ICI by kind | {_kinds(mt['collectives'].get('ici', {}))} | "
        f"{_kinds(ours['collectives'].get('ici', {}))} | |",
        f"| DCN (across slices) | {mt['dcn_bytes'] / 1e6:,.0f} MB: {_kinds(mt['collectives'].get('dcn', {}))} | "
        f"{ours['dcn_bytes'] / 1e6:,.0f} MB: {_kinds(ours['collectives'].get('dcn', {}))} | "
        f"{ratio(mt['dcn_bytes'], ours['dcn_bytes'])} |",
        f"| compiler | {mt['versions']} | {ours['versions']} | |",
    ]
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext-python", required=True, help="a Python interpreter with MaxText installed")
    p.add_argument("--trainer-python", default=sys.executable, help="the Python that runs trainer.compile")
    argv = sys.argv[1:]
    args = p.parse_args()
    out, tables = {}, {}
    for batch in BATCHES:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "mt").mkdir()
            (Path(tmp) / "ours").mkdir()
            mt = figures(maxtext(args.maxtext_python, Path(tmp) / "mt", batch))
            ours = figures(trainer(args.trainer_python, Path(tmp) / "ours", batch))
        out[f"per_device_batch_size={batch}"] = {"maxtext": mt, "trainer": ours}
        tables[f"batch{batch}"] = table(mt, ours, batch)
        print(f"per_device_batch_size={batch}\n{tables[f'batch{batch}']}", flush=True)
    # The interpreters are this machine's paths: the record names them by what they must have.
    names = {"--maxtext-python": "PYTHON_WITH_MAXTEXT", "--trainer-python": "PYTHON_WITH_THIS_TRAINER"}
    recorded = [names.get(prev, a) for prev, a in zip(["", *argv], argv)]
    write_record("compile_vs_maxtext", "compile_vs_maxtext", recorded, tables=tables, figures=out)


if __name__ == "__main__":
    main()
