"""Digests of the lowered train, eval and SDC programs for a fixed set of configurations, one line each.

A refactoring that must not change what runs on the device (moving modules, new seams, renamed wiring)
prints the same lines before and after: run it on both commits under the same JAX and diff the output.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/lowered_steps.py > before.txt
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from trainer.config import load_config  # noqa: E402
from trainer.program.layout import lower_step, slice_layout, train_spec  # noqa: E402

SMALL = [
    "base_num_decoder_layers=2",
    "base_emb_dim=64",
    "base_num_query_heads=4",
    "base_num_kv_heads=2",
    "head_dim=16",
    "base_mlp_dim=128",
    "vocab_size=256",
    "max_target_length=32",
    "per_device_batch_size=1",
    "run_name=lowered",
    "eval_interval=10",
    "eval_steps=2",
]

# name -> (overrides, slices, devices per slice)
CASES: dict[str, tuple[list[str], int, int]] = {
    "dense-1x1": (["model=qwen3-tiny"], 1, 1),
    "dense-fsdp4": (["model=qwen3-tiny", "ici_fsdp_parallelism=4"], 1, 4),
    "dense-tensor2-fsdp2": (["model=qwen3-tiny", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"], 1, 4),
    "dense-2slices-accum2": (
        ["model=qwen3-tiny", "ici_fsdp_parallelism=2", "num_slices=2", "gradient_accumulation_steps=2"],
        2,
        2,
    ),
    "dense-scan-remat-flash": (
        ["model=qwen3-tiny", "scan_layers=true", "remat_policy=full", "attention=flash", "ici_fsdp_parallelism=2"],
        1,
        2,
    ),
    "dense-bf16-zloss": (
        ["model=qwen3-tiny", "weight_dtype=bfloat16", "dtype=bfloat16", "z_loss_multiplier=1e-4"],
        1,
        1,
    ),
    "moe-expert2": (["model=qwen3-tiny-moe", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2"], 1, 4),
}


def lowered_texts(names: list[str], steps: list[str]):
    """(case, step, lowered text) for each case and step."""
    devices = jax.devices()
    for name in names:
        overrides, num_slices, per_slice = CASES[name]
        cfg = load_config("base.yml", SMALL + overrides)
        spec = train_spec(cfg)
        slices = [devices[i * per_slice : (i + 1) * per_slice] for i in range(num_slices)]
        layout = slice_layout(spec, slices)
        for step in steps:
            yield name, step, lower_step(spec, layout, step).as_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    parser.add_argument("--step", action="append", choices=["train", "eval", "sdc"], help="default: train, eval")
    parser.add_argument("--dump", metavar="DIR", help="also write each lowered text to DIR/<case>-<step>.mlir")
    args = parser.parse_args(argv)
    names = args.case or list(CASES)
    steps = args.step or ["train", "eval"]
    print(f"# jax {jax.__version__}")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for name, step, text in lowered_texts(names, steps):
        print(f"{name} {step} {hashlib.sha256(text.encode()).hexdigest()[:16]} {len(text)}", flush=True)
        if args.dump:
            with open(os.path.join(args.dump, f"{name}-{step}.mlir"), "w") as f:
                f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
