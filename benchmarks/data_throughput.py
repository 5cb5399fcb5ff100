"""Tokens per second of the ArrayRecord/Grain pipeline (SFT chats, packing, worker processes).

  python benchmarks/data_throughput.py [--workers 0 1 2] [--steps 40] [--batch 32] [--length 512]

Generates function-calling chats, writes them as ArrayRecord shards in a temporary directory, and
times the training iterator (tokenize, template, pack, batch) after a warm-up that includes worker
start-up. "tokens" are non-padding positions. Each figure is printed next to QWEN3_MINI_TOKENS_PER_S,
what the qwen3-mini preset's CPU training step consumes: a pipeline that delivers ten times that never
holds a step up.
TRAINER_SMOKE=1 runs it all at minimal sizes (see cli_runs): few chats and steps, one worker setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from cli_runs import announce_smoke, smoke, smoke_cap  # noqa: E402

from trainer.config.schema import DataConfig  # noqa: E402
from trainer.data.grain_pipeline import make_arrayrecord_iterator  # noqa: E402
from trainer.data.shards import prepare  # noqa: E402

QWEN3_MINI_TOKENS_PER_S = 2048  # qwen3-mini's 2 x 512-token rows per step, at its fastest CPU step time


def _write_chats(path: Path, n: int) -> None:
    spec = importlib.util.spec_from_file_location("fc", REPO / "scripts" / "make_function_calling_data.py")
    fc = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fc)
    with open(path, "w") as f:
        for record in fc.generate(n, seed=123):
            f.write(json.dumps(record) + "\n")


def measure(cfg: DataConfig, *, batch: int, steps: int, warmup: int) -> dict:
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=batch)
    try:
        start = time.perf_counter()
        for _ in range(warmup):
            next(it)
        warm = time.perf_counter()
        tokens = 0
        for _ in range(steps):
            tokens += int((next(it)["segment_ids"] > 0).sum())
        seconds = time.perf_counter() - warm
    finally:
        it.close()
    return {
        "workers": cfg.grain_worker_count,
        "tokens_per_s": tokens / seconds,
        "fill": tokens / (steps * batch * cfg.max_target_length),
        "warmup_s": warm - start,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="global batch (rows)")
    parser.add_argument("--length", type=int, default=512, help="max_target_length (qwen3-mini: 512)")
    parser.add_argument("--chats", type=int, default=4000)
    args = parser.parse_args(argv)
    if smoke():
        args.workers = args.workers[:1]
    args.steps, args.warmup = smoke_cap(args.steps, 3), smoke_cap(args.warmup, 1)
    args.batch, args.length = smoke_cap(args.batch, 4), smoke_cap(args.length, 128)
    args.chats = smoke_cap(args.chats, 200)
    announce_smoke(
        f"{args.chats} chats, {args.steps} timed steps of {args.batch} x {args.length}, "
        f"grain_worker_count={args.workers[0]} only"
    )
    with tempfile.TemporaryDirectory() as tmp:
        _write_chats(Path(tmp) / "chats.jsonl", args.chats)
        prepare([str(Path(tmp) / "chats.jsonl")], Path(tmp) / "shards", 4, progress_stream=io.StringIO())
        base = DataConfig(
            dataset_type="arrayrecord",
            grain_train_files=f"{tmp}/shards/*.arrayrecord",
            use_sft=True,
            packing=True,
            max_target_length=args.length,
        )
        print(
            f"pipeline: {args.chats} chats, SFT, packing, global batch {args.batch} x {args.length}, "
            f"{args.steps} timed steps"
        )
        for workers in args.workers:
            r = measure(
                dataclasses.replace(base, grain_worker_count=workers),
                batch=args.batch,
                steps=args.steps,
                warmup=args.warmup,
            )
            print(
                f"grain_worker_count={workers}: {r['tokens_per_s']:,.0f} tokens/s "
                f"({r['tokens_per_s'] / QWEN3_MINI_TOKENS_PER_S:.0f}x qwen3-mini's ~{QWEN3_MINI_TOKENS_PER_S} "
                f"tokens/s; rows {r['fill']:.0%} full; warm-up {r['warmup_s']:.1f} s)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
