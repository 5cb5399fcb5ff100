"""Realised proportions of a two-source data mixture, counted in documents of the batches the trainer reads.

    python benchmarks/mixture_proportions.py [--weights 0.5 0.7 0.9] [--steps 50 200] [--rows 8]

Source A holds short documents and source B long ones (so B fills rows faster: the harder case for a
mixture counted in documents). For each weight of A and each run length it reads `--steps` global
batches of `--rows` rows from `make_arrayrecord_iterator` (the trainer's pipeline, in process) and prints
the share of A's documents against its weight, then the table of them, which it writes to the record
benchmarks/records/mixture_proportions.json (the README's table is rendered from it). TRAINER_SMOKE=1 runs
one small case and records nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from array_record.python import array_record_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import announce_smoke, smoke  # noqa: E402
from records import write_record  # noqa: E402

from trainer.config.schema import DataConfig  # noqa: E402
from trainer.data.grain_pipeline import make_arrayrecord_iterator  # noqa: E402
from trainer.data.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"


def write_source(path: Path, tag: str, n: int, words: int) -> str:
    writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
    for i in range(n):
        writer.write(json.dumps({"text": f"rec{tag}{i:05d} " + " ".join(["alpha"] * words)}).encode())
    writer.close()
    return str(path)


def share_of_a(files: tuple[str, str], weight: float, steps: int, rows: int, tok: Tokenizer) -> tuple[float, int]:
    cfg = DataConfig(
        dataset_type="arrayrecord",
        grain_train_files=f"{files[0]},{weight};{files[1]},{1 - weight}",
        tokenizer_path=str(TOKENIZER),
        max_target_length=64,
        grain_worker_count=0,
    )
    it = make_arrayrecord_iterator(cfg, vocab_size=32768, global_batch_size=rows)
    a = b = 0
    for _ in range(steps):
        batch = next(it)
        for row in range(rows):
            seg = batch["segment_ids"][row]
            for s in range(1, seg.max() + 1):
                tags = re.findall(r"rec([AB])", tok.decode(batch["inputs"][row][seg == s]))
                a += tags.count("A")
                b += tags.count("B")
    it.close()
    return a / (a + b), a + b


def table(rows: list[dict]) -> str:
    """Markdown: one row per (weight, run length)."""
    lines = [
        "| weight of A | steps x rows | documents | realised share of A | error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['weight']:.2f} | {r['steps']} x {r['rows']} | {r['documents']} | {r['share_of_a']:.4f} | "
            f"{r['share_of_a'] - r['weight']:+.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    p.add_argument("--steps", type=int, nargs="+", default=[50, 200])
    p.add_argument("--rows", type=int, default=8)
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    if smoke():
        args.weights, args.steps, args.rows = [0.7], [5], 4
    announce_smoke("weight 0.7, 5 steps of 4 rows")
    tok = Tokenizer(TOKENIZER)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = (
            write_source(Path(tmp) / "a.arrayrecord", "A", 2000, 1),
            write_source(Path(tmp) / "b.arrayrecord", "B", 2000, 12),
        )
        for weight in args.weights:
            for steps in args.steps:
                share, docs = share_of_a(files, weight, steps, args.rows, tok)
                rows.append(
                    {"weight": weight, "steps": steps, "rows": args.rows, "documents": docs, "share_of_a": share}
                )
    print(table(rows))
    write_record("mixture_proportions", "mixture_proportions", argv, tables={"shares": table(rows)}, figures=rows)


if __name__ == "__main__":
    main()
