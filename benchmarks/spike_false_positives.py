"""How far a clean run's loss rises above its own running median: the false positives of loss-spike rollback.

    python benchmarks/spike_false_positives.py [--model qwen3-tiny] [--steps 150] [--sft-steps 120]
                                               [--seeds 0 1] [--learning-rates 1e-3 3e-3] [key=value ...]

Real text that every machine has, no download: the Python standard library's own source files and the
installed packages' descriptions and licence texts (their *.dist-info METADATA and LICENSE files), one
record per paragraph, tokenized with the bundled tokenizer by the project's tool (`python -m
trainer.data.prepare`) into a temporary directory. The trainer (`python -m trainer.train base.yml`, the
model preset's own run shape, the default learning-rate warm-up and schedule, loss-spike rollback off)
trains on it for `--steps` steps at each seed (init and data order) and learning rate, and on the
bundled function-calling sample (data/fc_sample, SFT) for `--sft-steps` steps at the preset's learning rate.

From each run's metrics.jsonl, offline: the ratio loss_t / median(previous losses, the last w, judged
once at least m are known) for each candidate (w, m) of `loss_spike_window` and `loss_spike_min_history`,
the largest ratio seen (over the whole run and over its first 20 steps, the warm-up), and the steps over
each candidate `loss_spike_threshold` (false positives: the run is clean). Prints the tables and writes
them to the record benchmarks/records/spike_false_positives.json. TRAINER_SMOKE=1 runs it all at minimal
sizes and records nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import records  # noqa: E402
from cli_runs import (  # noqa: E402
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    run,
    smoke,
    smoke_cap,
    smoke_overrides,
    step_records,
)
from corpus import prepare as prepare_corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BENCHMARK = "spike_false_positives"

CANDIDATES = [(32, 32), (32, 8), (32, 4), (16, 4), (8, 4), (8, 2)]  # (window, min history)
THRESHOLDS = [1.25, 1.5, 2.0, 3.0, 5.0]
WARMUP_STEPS = 20  # "first steps" in the tables
SFT_FILES = REPO / "data" / "fc_sample" / "*.arrayrecord"
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"


def prepare(out: Path) -> dict:
    corpus = prepare_corpus(out, tokenizer=TOKENIZER, limit=20 if smoke() else None)
    return {k: corpus[k] for k in ("files", "records", "tokens")}


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of each step with a loss (a step with no loss tokens, an SFT batch of prompts only, has
    none; the detector skips it too), in step order (the last record of a step wins)."""
    by_step = {r["step"]: r["loss"] for r in step_records(run_dir) if r.get("loss_tokens", 1) > 0}
    return [(s, by_step[s]) for s in sorted(by_step)]


def ratios(xs: list[tuple[int, float]], window: int, min_history: int) -> list[tuple[int, float]]:
    """(step, loss / median of the previous <= `window` losses) for each step judged (>= `min_history` known)."""
    out = []
    for i, (step, x) in enumerate(xs):
        prev = [loss for _, loss in xs[max(0, i - window) : i]]
        if len(prev) >= min_history:
            out.append((step, x / statistics.median(prev)))
    return out


def analyse(xs: list[tuple[int, float]]) -> dict:
    if not xs:  # smoke mode's short SFT rows hold no assistant token
        sys.exit("a run had no step with a loss")
    out = {"first_loss": round(xs[0][1], 3), "last_loss": round(xs[-1][1], 3), "steps": len(xs)}
    for w, m in CANDIDATES:
        rs = ratios(xs, w, m)
        early = [r for s, r in rs if s <= WARMUP_STEPS]
        step, top = max(rs, key=lambda sr: sr[1]) if rs else (None, None)
        out[f"w{w}_m{m}"] = {
            "first_judged_step": rs[0][0] if rs else None,
            "max_ratio": None if top is None else round(top, 4),
            "max_ratio_step": step,
            "max_ratio_first_steps": round(max(early), 4) if early else None,
            "false_positives": {str(t): sum(r > t for _, r in rs) for t in THRESHOLDS},
        }
    return out


def ratio_table(out: dict) -> str:
    cols = [f"w{w}_m{m}" for w, m in CANDIDATES]
    head = " | ".join(f"w={w}, m={m}" for w, m in CANDIDATES)
    lines = [
        f"| run ({out['model']}, {out['steps']} steps text / {out['sft_steps']} SFT): max loss / median "
        f"(step; max over steps 1-{WARMUP_STEPS}) | {head} |",
        "|---|" + "---|" * len(cols),
    ]
    for name, r in out["runs"].items():
        cells = []
        for c in cols:
            a = r[c]
            if a["max_ratio"] is None:
                cells.append("not judged")
                continue
            early = "-" if a["max_ratio_first_steps"] is None else f"{a['max_ratio_first_steps']:.3f}"
            cells.append(f"{a['max_ratio']:.3f} (step {a['max_ratio_step']}; {early})")
        lines.append(f"| {name}: loss {r['first_loss']:.2f} → {r['last_loss']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fp_table(out: dict, losses_by_run: dict[str, list[tuple[int, float]]]) -> str:
    judged = {c: sum(len(ratios(xs, *c)) for xs in losses_by_run.values()) for c in CANDIDATES}
    lines = [
        "| false positives (steps over the threshold, all runs) | "
        + " | ".join(f"w={w}, m={m} ({judged[(w, m)]} steps judged)" for w, m in CANDIDATES)
        + " |",
        "|---|" + "---|" * len(CANDIDATES),
    ]
    for t in THRESHOLDS:
        counts = [
            sum(r[f"w{w}_m{m}"]["false_positives"][str(t)] for r in out["runs"].values()) for w, m in CANDIDATES
        ]
        lines.append(f"| threshold {t:g} | " + " | ".join(map(str, counts)) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--sft-steps", type=int, default=120)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--learning-rates", type=float, nargs="+", default=[1e-3, 3e-3])
    p.add_argument("--save", type=Path, help="also write the figures and tables to this JSON file")
    p.add_argument("extra", nargs="*", help="more key=value for the trainer")
    argv = sys.argv[1:]
    args = p.parse_args(argv)
    steps, sft_steps = smoke_cap(args.steps, 12), smoke_cap(args.sft_steps, 8)
    shape = {k: v for k, v in SMOKE_SHAPE.items() if k != "vocab_size"}  # the tokenizer's 8192 ids must fit
    announce_smoke(f"{steps} + {sft_steps} steps, {SMOKE_SHAPE_TEXT} (vocabulary: the preset's)")
    common = [
        f"model={args.model}",
        "dataset_type=arrayrecord",
        f"tokenizer_path={TOKENIZER}",
        "loss_spike_threshold=0",  # measured offline: a rollback would change the run under measurement
        "enable_checkpointing=false",
        "log_period=50",
        *args.extra,
    ]
    out: dict = {"model": args.model, "steps": steps, "sft_steps": sft_steps, "runs": {}}
    losses_by_run = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out["corpus"] = prepare(root / "text")
        plan = [
            (
                f"text lr {lr:g} seed {seed}",
                steps,
                [
                    f"learning_rate={lr}",
                    f"init_weights_seed={seed}",
                    f"data_shuffle_seed={seed}",
                    f"grain_train_files={root / 'text' / '*.arrayrecord'}",
                ],
            )
            for lr in args.learning_rates
            for seed in args.seeds
        ]
        plan.append(("fc_sample SFT seed 0", sft_steps, ["use_sft=true", f"grain_train_files={SFT_FILES}"]))
        for i, (name, n, overrides) in enumerate(plan):
            print(f"run {name} ({n} steps)", file=sys.stderr, flush=True)
            run_dir = run(root, f"run{i}", smoke_overrides([*common, f"steps={n}", *overrides], **shape))
            xs = losses(run_dir)
            losses_by_run[name] = xs
            out["runs"][name] = analyse(xs)
    tables = {"ratios": ratio_table(out), "false_positives": fp_table(out, losses_by_run)}
    out["losses"] = {k: {s: round(x, 4) for s, x in v} for k, v in losses_by_run.items()}
    print(json.dumps({k: v for k, v in out.items() if k != "losses"}, indent=1))
    for t in tables.values():
        print(t + "\n")
    if args.save:
        args.save.write_text(json.dumps({"tables": tables, "figures": out}, indent=1) + "\n")
    records.write_record(BENCHMARK, BENCHMARK, argv, tables=tables, figures=out)


if __name__ == "__main__":
    main()
