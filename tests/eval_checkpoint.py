"""A tiny params-only checkpoint with its model.yml (as hf-to-trainer writes one), for the evaluation and
tokenizer-export tests; the fixture tokenizer is the HF tokenizer.json under tests/fixtures/lm_eval/."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import yaml

from trainer import model as qwen3
from trainer.checkpoint import save_parameters
from trainer.config.schema import ModelConfig

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "tests" / "fixtures" / "lm_eval" / "tokenizer.json"
ARCH = {
    "base_num_decoder_layers": 1,
    "base_emb_dim": 32,
    "base_num_query_heads": 2,
    "base_num_kv_heads": 1,
    "head_dim": 16,
    "base_mlp_dim": 64,
    "vocab_size": 512,
}


def write_checkpoint(root: Path, **tokenizer) -> Path:
    """Seed-0 params of ARCH at `root` and a model.yml of ARCH plus the `tokenizer` keys; returns `root`."""
    cfg = ModelConfig(**ARCH, dtype="float32", weight_dtype="float32")
    save_parameters(root, jax.jit(partial(qwen3.init_params, cfg))(jax.random.key(0)))
    (root / "model.yml").write_text(yaml.safe_dump({**ARCH, **tokenizer}))
    return root
