"""Data preparation throughput: tokens/s of `python -m trainer.data.prepare` with 1 and with N worker processes.

    python benchmarks/prepare_throughput.py [--workers 1 2] [--num-shards 8] [--unit-size 64M]

The corpus is real text on any machine (benchmarks/corpus.py: the standard library's modules, its
language and library reference and its licence), one record per paragraph, tokenized with the bundled
tokenizer (data/tokenizer/fc_sp8k.model). For each worker count the tool prepares the whole corpus from
scratch into a temporary directory, run as a user runs it; the first count is the baseline (1: a single
process). The shards must be byte-identical whatever the worker count: the benchmark fails otherwise.
It prints the markdown table (workers, seconds, tokens/s, tokens/s per core, speed-up over the
baseline; seconds and tokens/s as the tool measures and reports them, from its start to the complete
output, without the interpreter's start-up) and writes it to the record
benchmarks/records/prepare_throughput.json. TRAINER_SMOKE=1 prepares 20 files and records nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import announce_smoke, smoke  # noqa: E402
from corpus import fingerprint, text_inputs  # noqa: E402
from records import write_record  # noqa: E402

from trainer.data.shards import RUN_FIGURES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCHMARK = "prepare_throughput"
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"


def run(inputs: list[str], out: Path, workers: int, num_shards: int, unit_size: str) -> dict:
    cmd = [sys.executable, "-m", "trainer.data.prepare", "--output-dir", str(out), "--num-shards", str(num_shards)]
    cmd += ["--tokenizer", str(TOKENIZER), "--text-unit", "paragraph", "--workers", str(workers)]
    cmd += ["--unit-size", unit_size]
    for f in inputs:
        cmd += ["--input", f]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"preparing with {workers} workers failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    info = json.loads((out / "dataset_info.json").read_text())
    digest = hashlib.sha256()
    for name in info["shards"]:
        digest.update(name.encode() + b"\0" + (out / name).read_bytes())
    return {
        "workers": info["workers"],
        "seconds": info["seconds"],
        "wall_seconds": round(wall, 2),
        "tokens_per_s": info["tokens_per_s"],
        "tokens_per_s_per_core": info["tokens_per_s_per_core"],
        "records": info["records"],
        "tokens": info["tokens"],
        "units": info["units"],
        "shards_sha256": digest.hexdigest(),
        "data": {k: v for k, v in info.items() if k not in RUN_FIGURES},
    }


def table(rows: list[dict]) -> str:
    base = rows[0]["seconds"]
    lines = [
        "| workers | seconds | tokens/s | tokens/s per core | speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['workers']} | {r['seconds']:.2f} s | {r['tokens_per_s']:,.0f} tokens/s | "
            f"{r['tokens_per_s_per_core']:,.0f} tokens/s | {base / r['seconds']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (the first: baseline)")
    p.add_argument("--num-shards", type=int, default=8)
    p.add_argument("--unit-size", default="64M", help="the tool's --unit-size")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    inputs = text_inputs()
    if smoke():
        inputs = inputs[:20]
    announce_smoke("the first 20 files of the corpus")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in args.workers:
            print(f"preparing {len(inputs)} files with {workers} worker(s)", file=sys.stderr, flush=True)
            rows.append(run(inputs, Path(tmp) / f"w{workers}", workers, args.num_shards, args.unit_size))
    for r in rows[1:]:
        if r["shards_sha256"] != rows[0]["shards_sha256"] or r["data"] != rows[0]["data"]:
            sys.exit(f"the shards of {r['workers']} workers differ from those of {rows[0]['workers']}")
    corpus = {
        "files": len(inputs),
        "fingerprint": fingerprint(inputs)[:16],
        "bytes": sum(os.path.getsize(f) for f in inputs),
        "records": rows[0]["records"],
        "tokens": rows[0]["tokens"],
        "units": rows[0]["units"],
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    }
    figures = {"corpus": corpus, "runs": [{k: v for k, v in r.items() if k != "data"} for r in rows]}
    print(json.dumps(figures, indent=1))
    print(table(rows))
    write_record(BENCHMARK, BENCHMARK, argv, tables={"throughput": table(rows)}, figures=figures)


if __name__ == "__main__":
    main()
