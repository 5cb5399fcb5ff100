"""Long-context compile: qwen3-8b at 32k and 128k tokens on a v5p slice, this trainer's context parallelism
(both strategies) and MaxText's, read by the same HLO parser.

    python benchmarks/long_context_compile.py --maxtext-python PY [--trainer-python PY] [--topology v5p-128]
        [--context 8]

The job: qwen3-8b, max_target_length 32768 and 131072, per_device_batch_size 1/context (one sequence per
context group, the same fraction in both trainers), the sequence split `--context` ways
(ici_context_parallelism, the rest of the slice fsdp), strategy all_gather and ring, attention flash on
both sides (MaxText's ring requires it; this trainer's autoselected picks it under the split), each
trainer's defaults otherwise. Both trainers compile ahead of time on this machine
(libtpu, no TPU): this one with `trainer.compile --json` (its report's collectives come from
`trainer/aot/hlo.py`), MaxText with `train_compile` (its key names are the same; it needs
allow_split_physical_axes=true for a context axis on a v5p slice) with its optimized HLO dumped and read
by `trainer/aot/hlo.py`. Each row gives per-chip memory (arguments + temporaries; for a program the
compiler refused, the bytes it said it needed) and the ICI collective buffers of one step. The record is
benchmarks/records/long_context_compile.json.

per_device_batch_size counts every chip, the context axis included, in both trainers: a context group of
N chips holds per_device_batch_size x N sequences, so a chip's tokens per step are per_device_batch_size
x max_target_length whatever N is (`trainer.compile` prints them as tokens per chip). Both trainers take
a fraction, and 1/N puts one sequence on each context group: a chip holds max_target_length / N tokens
(131072 / 8 = 16384 on the default axis), the like-for-like point where the sequence split pays.

TRAINER_SMOKE=1 runs the same path on a v5p-8 with 2-layer models, 1024 tokens and a context axis of 2,
and records nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import smoke  # noqa: E402
from records import REPO, package_versions, write_record  # noqa: E402

sys.path.insert(0, str(REPO))
from trainer.aot import hlo  # noqa: E402
from trainer.program.batch_rows import per_device_text  # noqa: E402

STRATEGIES = ("all_gather", "ring")
GIB = 1 << 30
_NEEDS = re.compile(r"RESOURCE_EXHAUSTED[^\n]*?\(([0-9.]+)([KMGT])\)")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def job(args) -> dict:
    """The compiled job; in smoke mode the same shape at minimal sizes."""
    if smoke():
        return {
            "model": "qwen3-0.6b",
            "extra": ["base_num_decoder_layers=2"],
            "maxtext_extra": ["override_model_config=true"],  # else MaxText refuses a key its model sets
            "topology": "v5p-8",
            "context": 2,
            "lengths": (1024,),
        }
    return {
        "model": "qwen3-8b",
        "extra": [],
        "topology": args.topology,
        "context": args.context,
        "lengths": (32768, 131072),
    }


def _chips_per_slice(topology: str) -> int:
    from trainer.aot.topology import parse_topology

    return parse_topology(topology, 1).chips_per_slice


def batch(spec: dict) -> str:
    """per_device_batch_size as both trainers take it: 1/context, one sequence per context group."""
    return per_device_text(1 / spec["context"])


def _overrides(spec: dict, length: int, strategy: str) -> list[str]:
    """The keys both trainers read with the same meaning."""
    return [
        f"max_target_length={length}",
        f"per_device_batch_size={batch(spec)}",
        f"ici_context_parallelism={spec['context']}",
        "ici_fsdp_parallelism=-1",
        f"context_parallel_strategy={strategy}",
        *spec["extra"],
    ]


def _needed(text: str) -> int | None:
    """The bytes the compiler said a refused program needs ('... required ... (97.69G) exceeds ...')."""
    m = _NEEDS.search(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _summary(found: list) -> dict:
    summary = hlo.summarize(found)
    return {
        "collectives": summary,
        "ici_bytes": sum(v["bytes"] for v in summary.get("ici", {}).values()),
        "largest": hlo.largest(found, 3),
    }


def ours(python: str, spec: dict, length: int, strategy: str) -> dict:
    argv = [
        python,
        "-m",
        "trainer.compile",
        "base.yml",
        f"model={spec['model']}",
        f"compile_topology={spec['topology']}",
    ]
    argv += [*_overrides(spec, length, strategy), "--json", "--alternatives=none"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode not in (0, 4):
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"trainer.compile exited {proc.returncode}")
    (layout,) = json.loads(proc.stdout)["layouts"]
    m = layout["memory"]
    summary = layout["collectives"]
    return {
        "fits": m["fits"] and layout["eval"].get("fits", True),
        "memory_bytes": m["total"] if m["compiler_error"] else m["arguments"] + m["temporaries"],
        "compiler_error": m["compiler_error"],
        "collectives": summary,
        "ici_bytes": sum(v["bytes"] for v in summary.get("ici", {}).values()) if summary else None,
        "largest": layout["largest_collectives"][:3],
        "context": layout["context"],
        "global_batch_size": layout["global_batch_size"],
    }


def maxtext(python: str, spec: dict, length: int, strategy: str, work: Path) -> dict:
    base = subprocess.run(
        [python, "-c", "import maxtext, os; print(os.path.dirname(maxtext.__file__))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dump = work / "dump"
    # libtpu without a TPU, as trainer.compile sets it (its lock file would keep compiles from running
    # side by side, and it looks for the TPU VM's worker names).
    chips = _chips_per_slice(spec["topology"])
    env = {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": f"v5p-{2 * chips}",
        "TPU_WORKER_HOSTNAMES": "localhost",
        "TPU_WORKER_ID": "0",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
        **os.environ,
        "DECOUPLE_GCLOUD": "TRUE",
        "XLA_FLAGS": f"--xla_dump_to={dump}",
    }
    argv = [python, "-m", "maxtext.trainers.pre_train.train_compile", f"{base}/configs/base.yml"]
    argv += [
        f"compile_topology={spec['topology']}",
        "compile_topology_num_slices=1",
        f"model_name={spec['model']}",
        "allow_split_physical_axes=true",
        "attention=flash",  # MaxText's ring needs it; this trainer's autoselected runs flash under the split
        *spec.get("maxtext_extra", []),
        *(["use_tokamax_splash=true"] if strategy == "ring" else []),  # MaxText's TPU ring requires it
        *_overrides(spec, length, strategy),
    ]
    proc = subprocess.run(argv, env=env, cwd=work, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        needed = _needed(out)
        if needed is None:
            sys.stderr.write(out[-4000:])
            raise SystemExit(f"MaxText train_compile exited {proc.returncode}")
        return {"fits": False, "memory_bytes": needed, "compiler_error": "RESOURCE_EXHAUSTED", "ici_bytes": None}
    line = next(x for x in out.splitlines() if "CompiledMemoryStats(" in x)
    stats = {
        k: int(v)
        for k, v in (
            f.split("=") for f in line.replace(" ", "").split(",") if f.startswith(("argument_size", "temp_size"))
        )
    }
    (step,) = [p for p in dump.glob("*jit_train_step*after_optimizations.txt")]
    found = hlo.collectives(step.read_text(), devices_per_slice=chips, num_slices=1)
    return {
        "fits": True,
        "memory_bytes": stats["argument_size_in_bytes"] + stats["temp_size_in_bytes"],
        "compiler_error": None,
        **_summary(found),
    }


def _cell(side: dict) -> str:
    memory = f"{side['memory_bytes'] / GIB:.1f} GiB"
    if side["compiler_error"]:
        return f"needs {memory}: does not fit"
    return f"{memory}, ICI {side['ici_bytes'] / 1e9:.2f} GB"


def table(rows: dict, spec: dict) -> str:
    lines = [
        f"| {spec['model']} on {spec['topology']}, context {spec['context']}, "
        f"per_device_batch_size {batch(spec)} (1/context) | "
        "strategy | this trainer (`trainer.compile`) | MaxText (`train_compile`) |",
        "|---|---|---|---|",
    ]
    for key, r in rows.items():
        length, strategy = key.split("/")
        lines.append(f"| {int(length):,} tokens | {strategy} | {_cell(r['trainer'])} | {_cell(r['maxtext'])} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext-python", required=True, help="a Python interpreter with MaxText installed")
    p.add_argument("--trainer-python", default=sys.executable, help="the Python that runs trainer.compile")
    p.add_argument("--topology", default="v5p-128", help="the v5p slice to compile for (default v5p-128)")
    p.add_argument("--context", type=int, default=8, help="ici_context_parallelism (default 8)")
    argv = sys.argv[1:]
    args = p.parse_args()
    spec = job(args)
    rows = {}
    for length in spec["lengths"]:
        for strategy in STRATEGIES:
            with tempfile.TemporaryDirectory() as tmp:
                row = {
                    "trainer": ours(args.trainer_python, spec, length, strategy),
                    "maxtext": maxtext(args.maxtext_python, spec, length, strategy, Path(tmp)),
                }
            rows[f"{length}/{strategy}"] = row
            print(
                f"{length} tokens, {strategy}: ours {_cell(row['trainer'])}; MaxText {_cell(row['maxtext'])}",
                flush=True,
            )
    versions = {
        "trainer": package_versions(args.trainer_python, "jax", "libtpu"),
        "maxtext": package_versions(args.maxtext_python, "jax", "libtpu", "maxtext"),
    }
    rendered = table(rows, spec)
    print(rendered, flush=True)
    names = {"--maxtext-python": "PYTHON_WITH_MAXTEXT", "--trainer-python": "PYTHON_WITH_THIS_TRAINER"}
    recorded = [names.get(prev, a) for prev, a in zip(["", *argv], argv)]
    write_record(
        "long_context_compile",
        "long_context_compile",
        recorded,
        tables={"memory": rendered},
        figures={
            "job": {k: v for k, v in spec.items() if k != "lengths"} | {"lengths": list(spec["lengths"])},
            "rows": rows,
            "versions": versions,
        },
    )


if __name__ == "__main__":
    main()
