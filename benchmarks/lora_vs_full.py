"""LoRA against full fine-tuning: the same model and SFT data trained both ways, and qwen3-8b compiled both ways.

    python benchmarks/lora_vs_full.py [--model qwen3-tiny qwen3-mini] [--steps 30] [--rank 8]
        [--compile-model qwen3-8b] [--compile-topology v5e-16] [--compile-batch 9] [--no-compile] [key=value ...]

Per `--model`, two CLI runs of `--steps` steps of SFT on the bundled function-calling sample
(data/fc_sample, use_sft=true), one training the full model and one `lora_rank=--rank` adapters on all
seven projections over the same initial weights, each saving a checkpoint at its last step and then
resumed for one more step. Per run it reports:
- `step`: the median step time after the first 3 (compilation and warm-up);
- `peak RSS`: the trainer process's peak resident memory (`wait4`'s ru_maxrss: the process and the
  children it waited for), which includes the Python/JAX runtime;
- `trainable` and `optimizer state`: bytes of the trained params (the model, or the adapters) and of
  their AdamW state, from the train state's abstract shapes;
- `checkpoint`: bytes of the saved step on disk, and `restore`: the resumed run's restore time
  (`restore_end`: the train state read and placed on the devices; a LoRA run also reads its base, which
  is not part of the state).
Then, unless `--no-compile`, `python -m trainer.compile` compiles `--compile-model` for
`--compile-topology` with `per_device_batch_size=--compile-batch`, once for full training and once with
LoRA (the default point is one where full training does not fit a chip's HBM and LoRA does), and prints
per chip the params, optimizer state, temporaries and the compiler's total against the chip's HBM, and
whether each fits (a program the compiler refuses for HBM fits not, at the size it said it
needed). Extra `key=value` arguments go to the training runs.
It writes the record benchmarks/records/lora_vs_full.json (tables `training` and `compile`).
TRAINER_SMOKE=1 runs the same path at minimal sizes (a few steps of a 2-layer model, for the first
`--model` only; qwen3-tiny compiled for a v5e-4 instead of qwen3-8b) and records nothing.
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
from cli_runs import (  # noqa: E402
    SMOKE_SHAPE,
    SMOKE_SHAPE_TEXT,
    announce_smoke,
    env_with_devices,
    median,
    read_jsonl,
    smoke,
    smoke_cap,
    smoke_env,
    smoke_overrides,
    step_times,
    trainer_cmd,
)
from records import write_record  # noqa: E402

from trainer.observe import catalogue  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GIB, MB = 1 << 30, 1e6
SFT = ["use_sft=true", "dataset_type=arrayrecord", f"grain_train_files={REPO / 'data/fc_sample/*.arrayrecord'}"]
MODES = ("full", "lora")
# Smoke runs cap the model as the other benchmarks do, but keep the vocabulary of the sample's tokenizer
# (data/tokenizer/fc_sp8k.model: 8192 ids).
SMOKE_CAPS = {**SMOKE_SHAPE, "vocab_size": 8192}


def run_measured(root: Path, name: str, overrides: list[str]) -> tuple[Path, int]:
    """(run directory, peak RSS bytes) of one trainer CLI run on one device; exits if it fails."""
    log = root / f"{name}.stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            trainer_cmd(root, name, overrides), stdout=subprocess.DEVNULL, stderr=err, env=env_with_devices(1)
        )
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"trainer run {name} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return root / name, usage.ru_maxrss * 1024  # Linux: KiB


def state_bytes(overrides: list[str]) -> dict:
    """Bytes of the trained params and of their optimizer state, from the train state's abstract shapes."""
    from trainer.config import load_config
    from trainer.program.optim import learning_rate_schedule, make_optimizer
    from trainer.program.state import abstract_train_state, trainable_logical_axes

    cfg = load_config("base.yml", [*overrides, "run_name=sizes"])
    lora = cfg.lora if cfg.lora.lora_rank > 0 else None
    schedule = learning_rate_schedule(cfg.optim, steps=cfg.train.steps)
    optimizer = make_optimizer(cfg.optim, trainable_logical_axes(cfg.model, lora), schedule=schedule)
    state = abstract_train_state(cfg.model, optimizer, lora)

    def size(tree) -> int:
        import jax
        import numpy as np

        return int(sum(leaf.size * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))

    return {"trainable_bytes": size(state["params"]), "optimizer_bytes": size(state["opt_state"])}


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(root: Path, model: str, mode: str, args) -> dict:
    """One column: `--steps` steps of SFT (full or LoRA) saving its last step, then resumed for one more."""
    lora = [f"lora_rank={args.rank}"] if mode == "lora" else []
    common = smoke_overrides(
        [f"model={model}", *SFT, *lora, "log_period=1000", "max_num_checkpoints_to_keep=2", *args.extra],
        **SMOKE_CAPS,
    )
    name = f"{model}-{mode}"
    first = [*common, f"steps={args.steps}", f"checkpoint_period={args.steps}"]
    run_dir, peak = run_measured(root, name, first)
    times = step_times(run_dir)
    checkpoint = run_dir / "checkpoints" / str(args.steps)
    if not checkpoint.is_dir():
        sys.exit(f"{name}: no checkpoint of step {args.steps} under {run_dir / 'checkpoints'}")
    resumed = [
        *common,
        f"steps={args.steps + 1}",
        f"checkpoint_period={args.steps}",
        f"learning_rate_schedule_steps={args.steps}",
    ]
    run_measured(root, name, resumed)
    restores = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == catalogue.RESTORE_END]
    restore = restores[-1]
    if not str(restore.get("source", "")).startswith("checkpoint:"):
        sys.exit(f"{name}: the resumed run restored from {restore.get('source')!r}, not its checkpoint")
    return {
        "model": model,
        "mode": mode,
        "rank": args.rank if mode == "lora" else 0,
        "steps": args.steps,
        "extra": args.extra,
        "step_s": median(times or step_times(run_dir, skip=0)),
        "peak_rss_bytes": peak,
        **state_bytes(first),
        "checkpoint_bytes": directory_bytes(checkpoint),
        "restored_bytes": restore["bytes"],
        "restore_s": restore["seconds"],
    }


def compile_case(mode: str, args) -> dict:
    """`trainer.compile --json` of the compile point, full or LoRA: its first layout's memory per chip."""
    lora = [f"lora_rank={args.rank}"] if mode == "lora" else []
    if smoke():
        point = ["model=qwen3-tiny", "max_target_length=64", "compile_topology=v5e-4"]
    else:
        point = [
            f"model={args.compile_model}",
            f"compile_topology={args.compile_topology}",
            f"per_device_batch_size={args.compile_batch}",
        ]
    cmd = [sys.executable, "-m", "trainer.compile", "base.yml", *point, *lora, "--alternatives", "none", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=smoke_env(dict(os.environ)))
    if proc.returncode not in (0, 4):  # 4: does not fit, which is a result here
        sys.exit(f"{' '.join(cmd[1:])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout)
    memory = report["layouts"][0]["memory"]
    refused = memory["compiler_error"] is not None  # no program: the compiler says only what it needed
    return {
        "mode": mode,
        "args": point + lora,
        "model": report["model"],
        "target": report["target"],
        "hbm_bytes": report["hbm_bytes"],
        "params_bytes": memory["params"],
        "optimizer_bytes": memory["optimizer"],
        "arguments_bytes": None if refused else memory["arguments"],
        "temporaries_bytes": None if refused else memory["temporaries"],
        "total_bytes": memory["total"] if memory["total"] is not None else memory["required"],
        "fits": bool(memory["fits"]),
        "compiler_error": memory["compiler_error"],
    }


def _mb(n: float) -> str:
    return f"{n / MB:,.1f} MB"


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f} GiB"


TRAINING_ROWS = [
    ("median step time", lambda c: f"{c['step_s']:.3f} s"),
    ("peak RSS of the trainer process", lambda c: _mb(c["peak_rss_bytes"])),
    ("trained params", lambda c: _mb(c["trainable_bytes"])),
    ("optimizer state (AdamW)", lambda c: _mb(c["optimizer_bytes"])),
    ("checkpoint of one step on disk", lambda c: _mb(c["checkpoint_bytes"])),
    ("restore (read + place on devices)", lambda c: f"{c['restore_s']:.2f} s"),
]


def training_table(cols: list[dict]) -> str:
    """Markdown: a column per (model, full or LoRA), in the order measured."""
    first = cols[0]
    corner = f"SFT on data/fc_sample, {first['steps']} steps, one CPU device" + "".join(
        f", {e}" for e in first["extra"]
    )
    labels = [f"{c['model']}, " + ("full" if c["mode"] == "full" else f"LoRA r={c['rank']}") for c in cols]
    lines = [f"| {corner} | " + " | ".join(labels) + " |", "|---|" + "---|" * len(cols)]
    for name, cell in TRAINING_ROWS:
        lines.append(f"| {name} | " + " | ".join(cell(c) for c in cols) + " |")
    return "\n".join(lines)


def compile_table(cases: list[dict]) -> str:
    """Markdown: per chip memory of the compile point, full training against LoRA."""
    first = cases[0]
    corner = f"{first['model']} on one {first['target']}, per chip (HBM {_gib(first['hbm_bytes'])})"
    labels = ["full" if c["mode"] == "full" else "LoRA" for c in cases]
    rows = [
        ("params (LoRA: the adapters)", lambda c: _gib(c["params_bytes"])),
        ("optimizer state", lambda c: _gib(c["optimizer_bytes"])),
        ("arguments (state, base, batch)", lambda c: _gib(c["arguments_bytes"])),
        ("temporaries", lambda c: _gib(c["temporaries_bytes"])),
        ("**compiler's total** (refused: what it asked for)", lambda c: f"**{_gib(c['total_bytes'])}**"),
        ("fits", lambda c: "yes" if c["fits"] else "**no**"),
    ]
    lines = [f"| {corner} | " + " | ".join(labels) + " |", "|---|" + "---|" * len(cases)]
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(c) for c in cases) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["qwen3-tiny", "qwen3-mini"], help="models, measured in turn")
    p.add_argument("--steps", type=int, default=30, help="steps per run (the checkpoint is of the last)")
    p.add_argument("--rank", type=int, default=8, help="the LoRA runs' lora_rank")
    p.add_argument("--compile-model", default="qwen3-8b")
    p.add_argument("--compile-topology", default="v5e-16")
    p.add_argument("--compile-batch", type=int, default=9, help="per_device_batch_size of the compile point")
    p.add_argument("--no-compile", action="store_true", help="skip the AOT compile comparison")
    p.add_argument("extra", nargs="*", help="more key=value for the training runs")
    argv = sys.argv[1:]
    args = p.parse_args([a for a in argv if "=" not in a or a.startswith("-")])
    args.extra = [a for a in argv if "=" in a and not a.startswith("-")]
    args.steps = smoke_cap(args.steps, 4)
    shape = SMOKE_SHAPE_TEXT.replace("vocabulary 512", "vocabulary 8192")
    announce_smoke(f"{args.steps} steps, {shape}; qwen3-tiny compiled for a v5e-4")
    models = args.model[:1] if smoke() else args.model  # smoke runs cap every model to the same shape
    cols = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            for mode in MODES:
                cols.append(measure(Path(tmp), model, mode, args))
                print(json.dumps(cols[-1]), flush=True)
    tables = {"training": training_table(cols)}
    print(tables["training"])
    cases = [] if args.no_compile else [compile_case(mode, args) for mode in MODES]
    if cases:
        tables["compile"] = compile_table(cases)
        print(tables["compile"])
        for c in cases:
            print(f"{c['mode']}: {_gib(c['total_bytes'])} per chip of {_gib(c['hbm_bytes'])}, fits={c['fits']}")
            if c["compiler_error"]:
                print(f"  the compiler refused it: {c['compiler_error']}")
    write_record("lora_vs_full", "lora_vs_full", argv, tables=tables, figures={"training": cols, "compile": cases})


if __name__ == "__main__":
    main()
