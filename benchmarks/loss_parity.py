"""Loss parity with MaxText: the same model, text, tokenizer, initial weights and hyperparameters, trained
by this trainer and by MaxText, their loss curves side by side.

    python benchmarks/loss_parity.py --maxtext-python PY [--train-files GLOB] [--steps 300]
                                     [--model qwen3-mini] [--batch 4] [--seq 256] [--last 50]

`--maxtext-python` is an interpreter with MaxText 0.2.5 installed (Python >= 3.12; install notes in
benchmarks/compile_vs_maxtext.py's docstring). What both runs share:

- **Text.** `--train-files`: ArrayRecord shards of text records (`python -m trainer.data.prepare` without
  `--tokenizer`). Default: the project's real-text corpus (benchmarks/corpus.py: the Python standard
  library's modules, its language and library reference and its licence, one record per paragraph),
  prepared into a temporary directory. benchmarks/maxtext_side.py rewrites the same records, in the same
  order, as the tf.train.Example shards MaxText's Grain pipeline reads; each trainer tokenizes them itself
  with the bundled sentencepiece tokenizer (no BOS, EOS after every document), packs whole documents
  into rows of `--seq` tokens and shuffles with seed 0.
- **Model and initial weights.** The preset's architecture (MaxText's `decoder_block=qwen3` with the same
  dimensions, float32, untied logits normalisation off as in MaxText's own Qwen3 configs). One set of
  initial weights, this trainer's initialisation at seed 0 (Hugging Face's for Qwen3: normal(0, 0.02)),
  exported to Hugging Face safetensors and loaded by both: this trainer through `load_parameters_path`,
  MaxText through its own converter (`maxtext.checkpoint_conversion.to_maxtext`). MaxText's own
  initialisation is not used: with tied embeddings and no logit normalisation (Qwen3's), its unit-variance
  embedding starts the loss at ~200 instead of ln(vocab).
- **Optimisation.** AdamW (b1 0.9, b2 0.95, eps 1e-8, weight decay 0.1), global-norm clipping at 1,
  linear warm-up over 10% of the steps then cosine decay to 10% of the preset's learning rate, `--batch`
  sequences per step on one device, `--steps` steps, no z-loss, no dropout.

What differs, by design of each trainer: the packing (this trainer's per-row streams against Grain's
first-fit bins) and the shuffle, so the two see the same distribution of documents in different orders
and fill their rows differently. The comparison is therefore at equal trained tokens: each run's loss is
averaged over its last `--last` steps up to the point where both have trained the same number of (loss)
tokens, the smaller of the two totals. Prints both curves (every 10th step) and the ratio; writes the
record benchmarks/records/loss_parity.json and the plot docs/images/loss_parity.png, both rendered in
docs/training_quality.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli_runs import read_jsonl, run, step_records  # noqa: E402
from corpus import prepare as prepare_text  # noqa: E402
from maxtext_cpu import maxtext_overrides, maxtext_version, run_maxtext  # noqa: E402
from records import REPO, write_record  # noqa: E402

from trainer.config.schema import ARCHITECTURE_KEYS, FAMILY_KEYS  # noqa: E402

BENCHMARK = "loss_parity"
TOKENIZER = REPO / "data" / "tokenizer" / "fc_sp8k.model"
PLOT = REPO / "docs" / "images" / "loss_parity.png"
SEED = 0
OPTIM = {  # this trainer's key -> MaxText's key, value
    "adam_b1": ("adam_b1", 0.9),
    "adam_b2": ("adam_b2", 0.95),
    "adam_eps": ("adam_eps", 1e-8),
    "adam_weight_decay": ("adam_weight_decay", 0.1),
    "gradient_clipping_threshold": ("gradient_clipping_threshold", 1.0),
    "warmup_steps_fraction": ("warmup_steps_fraction", 0.1),
    "cosine_learning_rate_final_fraction": ("learning_rate_final_fraction", 0.1),
    "z_loss_multiplier": ("z_loss_multiplier", 0.0),
    "data_shuffle_seed": ("data_shuffle_seed", SEED),
}


def maxtext_side(python: str, *args: str) -> str:
    cmd = [python, str(REPO / "benchmarks" / "maxtext_side.py"), *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu", DECOUPLE_GCLOUD="TRUE")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def initial_weights(model_cfg, work: Path) -> tuple[Path, Path]:
    """This trainer's initialisation at SEED as a params-only checkpoint and as Hugging Face safetensors."""
    import jax

    from trainer import model
    from trainer.checkpoint.params import save_parameters
    from trainer.hf.to_hf import trainer_to_hf

    params_dir, hf_dir = work / "init_params", work / "init_hf"
    save_parameters(params_dir, model.init_params(model_cfg, jax.random.key(SEED)))
    trainer_to_hf(params_dir, hf_dir, model=model_cfg.model)
    return params_dir, hf_dir


def ours(work: Path, files: str, init: Path, args, lr: float) -> list[tuple[float, int, float]]:
    overrides = [
        f"model={args.model}",
        f"steps={args.steps}",
        f"per_device_batch_size={args.batch}",
        f"max_target_length={args.seq}",
        "dataset_type=arrayrecord",
        f"grain_train_files={files}",
        f"tokenizer_path={TOKENIZER}",
        "add_bos=false",
        "add_eos=true",
        "packing=true",
        f"load_parameters_path={init}",
        f"learning_rate={lr}",
        *(f"{k}={v}" for k, (_, v) in OPTIM.items()),
        "loss_spike_threshold=0",
        f"checkpoint_period={args.steps}",
    ]
    run_dir = run(work / "runs", "trainer", overrides)
    by_step = {r["step"]: (r["loss"], r["loss_tokens"], r["learning_rate"]) for r in step_records(run_dir)}
    return [by_step[s] for s in sorted(by_step)]


def maxtext(work: Path, files: str, init: Path, model_cfg, args, lr: float) -> list[tuple[float, int, float]]:
    overrides = maxtext_overrides(
        model_cfg, max_target_length=args.seq, per_device_batch_size=args.batch, steps=args.steps, devices=1
    )
    overrides = [o for o in overrides if not o.startswith("dataset_type=")]
    overrides += [
        "dataset_type=grain",
        "grain_file_type=arrayrecord",
        f"grain_train_files={files}",
        "grain_worker_count=1",
        "tokenizer_type=sentencepiece",
        f"tokenizer_path={TOKENIZER}",
        "add_bos=false",
        "add_eos=true",
        "packing=true",
        "normalize_embedding_logits=false",  # Qwen3 (MaxText's configs/models/qwen3-*.yml)
        "enable_dropout=false",
        "enable_data_shuffling=true",
        f"load_parameters_path={init}",
        f"learning_rate={lr}",
        *(f"{mk}={v}" for mk, v in OPTIM.values()),
    ]
    out = work / "maxtext"
    run_maxtext(args.maxtext_python, overrides, 1, out)
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "learning/loss" in r]
    by_step = {
        int(r["step"]): (r["learning/loss"], int(r["learning/total_weights"]), r["learning/current_learning_rate"])
        for r in rows
    }
    return [by_step[s] for s in sorted(by_step)]


def at_tokens(curve: list[tuple], tokens: int, last: int) -> tuple[float, int]:
    """(mean loss of the `last` steps ending where the cumulative loss tokens reach `tokens`, that step)."""
    total, end = 0, len(curve)
    for i, (_, n, _) in enumerate(curve):
        total += n
        if total >= tokens:
            end = i + 1
            break
    window = curve[max(0, end - last) : end]
    return sum(row[0] for row in window) / len(window), end


def compare(ours_curve, mt_curve, last: int) -> dict:
    totals = (sum(row[1] for row in ours_curve), sum(row[1] for row in mt_curve))
    tokens = min(totals)
    ours_loss, ours_step = at_tokens(ours_curve, tokens, last)
    mt_loss, mt_step = at_tokens(mt_curve, tokens, last)
    return {
        "loss_tokens_total": {"trainer": totals[0], "maxtext": totals[1]},
        "equal_tokens": tokens,
        "trainer": {"final_loss": round(ours_loss, 4), "at_step": ours_step},
        "maxtext": {"final_loss": round(mt_loss, 4), "at_step": mt_step},
        "ratio": round(ours_loss / mt_loss, 4),
        "first_step_loss": {"trainer": round(ours_curve[0][0], 4), "maxtext": round(mt_curve[0][0], 4)},
        # The schedules must agree: the same hyperparameters, read back from each run's own metrics.
        "learning_rate_max_abs_difference": max(abs(a[2] - b[2]) for a, b in zip(ours_curve, mt_curve)),
    }


def plot(ours_curve, mt_curve, result: dict, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for curve, label, color in ((ours_curve, "this trainer", "tab:blue"), (mt_curve, "MaxText", "tab:orange")):
        xs, total = [], 0
        for row in curve:
            total += row[1]
            xs.append(total / 1e3)
        ys = [row[0] for row in curve]
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
        k = 20
        smooth = [sum(ys[max(0, i - k + 1) : i + 1]) / len(ys[max(0, i - k + 1) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, color=color, linewidth=1.8, label=f"{label} (mean of {k} steps)")
    ax.axvline(result["equal_tokens"] / 1e3, color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="trained tokens (thousands)", ylabel="training loss", title=title)
    ax.set_ylim(top=min(11.0, ax.get_ylim()[1]))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    plt.close(fig)


def table(result: dict, args, model_cfg, versions: str, corpus: str) -> str:
    t, m = result["trainer"], result["maxtext"]
    rows = [
        "| | this trainer | MaxText |",
        "|---|---|---|",
        f"| final loss (mean of the last {args.last} steps, at equal tokens) | {t['final_loss']:.4f} | "
        f"{m['final_loss']:.4f} |",
        f"| at step | {t['at_step']} | {m['at_step']} |",
        f"| loss tokens trained in {args.steps} steps | {result['loss_tokens_total']['trainer']:,} | "
        f"{result['loss_tokens_total']['maxtext']:,} |",
        f"| ratio (this trainer / MaxText) | {result['ratio']:.4f} | |",
        f"| loss of the first step (the same initial weights) | {result['first_step_loss']['trainer']:.4f} | "
        f"{result['first_step_loss']['maxtext']:.4f} |",
        f"| learning rate, largest difference between the runs' schedules | "
        f"{result['learning_rate_max_abs_difference']:.1e} | |",
    ]
    params = f"{args.model}, {model_cfg.base_num_decoder_layers} layers x {model_cfg.base_emb_dim}"
    notes = (
        f"\n\n{params}, vocabulary {model_cfg.vocab_size}; {args.batch} x {args.seq} tokens per step; {corpus}; "
        f"{versions}."
    )
    return "\n".join(rows) + notes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--maxtext-python", required=True, help="a Python interpreter with MaxText installed")
    p.add_argument("--train-files", help="ArrayRecord text shards (default: the project's corpus, prepared)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--model", default="qwen3-mini")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--last", type=int, default=50, help="steps the final loss is averaged over")
    args = p.parse_args()

    sys.path.insert(0, str(REPO))
    from trainer.config import load_config

    cfg = load_config("base.yml", [f"model={args.model}"])
    lr = cfg.optim.learning_rate
    with tempfile.TemporaryDirectory(prefix="loss_parity_") as tmp:
        work = Path(tmp)
        prepared = None if args.train_files else prepare_text(work / "corpus")
        files = args.train_files or prepared["glob"]
        corpus = (
            "the given shards"
            if args.train_files
            else f"the project's real-text corpus (benchmarks/corpus.py, {prepared['files']} files, "
            f"fingerprint {prepared['fingerprint']})"
        )
        maxtext_side(args.maxtext_python, "data", "--input", files, "--output-dir", str(work / "mt_corpus"))
        params_dir, hf_dir = initial_weights(cfg.model, work)
        mt_init = work / "init_maxtext"
        model_keys = maxtext_overrides(
            cfg.model, max_target_length=args.seq, per_device_batch_size=1, steps=1, devices=1
        )
        arch = [o for o in model_keys if o.split("=")[0] in _ARCH_KEYS]
        maxtext_side(args.maxtext_python, "init", "--hf-dir", str(hf_dir), "--output-dir", str(mt_init), *arch)
        print(f"training this trainer: {args.steps} steps", flush=True)
        ours_curve = ours(work, files, params_dir, args, lr)
        print(f"training MaxText: {args.steps} steps", flush=True)
        mt_curve = maxtext(work, str(work / "mt_corpus" / "*.array_record"), mt_init, cfg.model, args, lr)
    result = compare(ours_curve, mt_curve, args.last)
    print("step  this trainer  MaxText")
    for s in range(0, min(len(ours_curve), len(mt_curve)), 10):
        print(f"{s:4d}  {ours_curve[s][0]:12.4f}  {mt_curve[s][0]:7.4f}")
    print(json.dumps(result, indent=1))
    versions = maxtext_version(args.maxtext_python)
    plot(ours_curve, mt_curve, result, f"{args.model} on real text: this trainer and {versions}")
    argv = ["--maxtext-python", "PYTHON_WITH_MAXTEXT", "--steps", str(args.steps), "--model", args.model]
    argv += ["--batch", str(args.batch), "--seq", str(args.seq), "--last", str(args.last)]
    argv += ["--train-files", args.train_files] if args.train_files else []
    figures = {
        **result,
        "maxtext": {**result["maxtext"], "version": versions},
        "curves": {"trainer": ours_curve, "maxtext": mt_curve},
        "model": args.model,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "learning_rate": lr,
    }
    write_record(
        BENCHMARK,
        BENCHMARK,
        argv,
        tables={"parity": table(result, args, cfg.model, versions, corpus)},
        figures=figures,
    )


# The keys MaxText's HF converter needs to build the same architecture (dtypes and remat are run settings).
_ARCH_KEYS = {*(k for k in ARCHITECTURE_KEYS if k not in FAMILY_KEYS), "scan_layers"}

if __name__ == "__main__":
    main()
