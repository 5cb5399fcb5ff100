"""Generate the Hugging Face parity fixtures under tests/fixtures/hf/ (developer-run, not in CI).

Needs `transformers` and a CPU `torch`, which the tests do not:

    pip install /opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl transformers
    python scripts/make_hf_fixtures.py            # rewrites tests/fixtures/hf/
    python scripts/make_hf_fixtures.py --only llama_tied --only llama_untied_kv1   # just these

Then it checks the other direction, which the tests cannot (they run without torch): each fixture goes
through `python -m trainer.convert hf-to-trainer` and `trainer-to-hf`, and transformers must load the
export and give the same logits.

Each fixture is a tiny random model saved by `save_pretrained` (float32 safetensors + config.json) and
`expected.npz` with what transformers computes for it:
    input_ids [2, 10] int32, logits [2, 10, V] float32 (eager attention), loss () float32
    (`model(input_ids, labels=input_ids).loss`: mean next-token cross-entropy), prompt_ids [P] int32 and
    greedy_ids [N] int32 (`generate(do_sample=False)`, no EOS), greedy_margin () float32 (the smallest
    top-1 minus top-2 logit along the greedy path: how far from a tie each greedy choice is).

The models are deliberately awkward: head_dim is not hidden/heads, every RMSNorm weight is random
(not 1), one model has a single KV head and an untied head, and weights are scaled up from the HF
init so that logits differ clearly between tokens. `dense_untied_kv1` and `llama_untied_kv1` are written
with the legacy spelling (transformers 4.x checkpoints: a top-level `rope_theta`, the scaling under
`rope_scaling`, and for the Llama no `head_dim`, which then defaults to hidden / heads); the others with
`rope_parameters`. The Llama models use the `llama3` RoPE scaling with an original context of a few dozen
positions, so that most of their frequencies are rescaled or smoothed within the fixtures' sequences.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf"
COMMON = dict(
    vocab_size=160,
    hidden_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
FIXTURES = {
    "dense_tied": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            COMMON,
            num_key_value_heads=2,
            intermediate_size=80,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        ),
    ),
    "dense_untied_kv1": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(
            COMMON,
            num_key_value_heads=1,
            intermediate_size=80,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
    "moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            COMMON,
            num_key_value_heads=2,
            intermediate_size=80,
            moe_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
    ),
}
LLAMA = dict(COMMON, rms_norm_eps=1e-5, mlp_bias=False, intermediate_size=80)
FIXTURES.update(
    {
        "llama_tied": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            dict(
                LLAMA,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500_000.0,
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        ),
        "llama_untied_kv1": (
            transformers.LlamaConfig,
            transformers.LlamaForCausalLM,
            dict(
                {k: v for k, v in LLAMA.items() if k != "head_dim"},
                num_key_value_heads=1,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500_000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 2.0,
                    "original_max_position_embeddings": 32,
                },
            ),
        ),
    }
)
LEGACY_ROPE_SPELLING = {"dense_untied_kv1", "llama_untied_kv1"}
BATCH, SEQ, PROMPT_LEN, NEW_TOKENS = 2, 10, 6, 12


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights ~ 1 + 0.3 N(0,1); embedding ~ 0.5 N(0,1); every other matrix ~ 0.12 N(0,1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.12 * noise)


def _greedy(model, prompt: torch.Tensor) -> tuple[np.ndarray, float]:
    out = model.generate(
        prompt,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    margins = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(float(top2[0] - top2[1]))
    return out.sequences[0, prompt.shape[1] :].numpy().astype(np.int32), min(margins)


def make(name: str, seed: int) -> dict:
    config_cls, model_cls, kwargs = FIXTURES[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    model.config._attn_implementation = "eager"
    _randomize(model, seed)
    out_dir = OUT / name
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    if name in LEGACY_ROPE_SPELLING:
        cfg_path = out_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
        if "head_dim" not in kwargs:
            cfg.pop("head_dim", None)
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in out_dir.glob("generation_config.json"):
        extra.unlink()

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, kwargs["vocab_size"], size=(BATCH, SEQ), dtype=np.int64)
    prompt = rng.integers(0, kwargs["vocab_size"], size=(1, PROMPT_LEN), dtype=np.int64)
    with torch.no_grad():
        result = model(torch.from_numpy(ids), labels=torch.from_numpy(ids))
        greedy, margin = _greedy(model, torch.from_numpy(prompt))
    np.savez(
        out_dir / "expected.npz",
        input_ids=ids.astype(np.int32),
        logits=result.logits.float().numpy(),
        loss=np.float32(result.loss.item()),
        prompt_ids=prompt[0].astype(np.int32),
        greedy_ids=greedy,
        greedy_margin=np.float32(margin),
    )

    # The fixture must load back through transformers exactly as saved (the legacy spelling included).
    reloaded = model_cls.from_pretrained(out_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        again = reloaded(torch.from_numpy(ids)).logits.float().numpy()
    assert np.array_equal(again, result.logits.float().numpy()), f"{name}: reload changed the logits"
    return {
        "loss": float(result.loss),
        "greedy_margin": margin,
        "bytes": sum(p.stat().st_size for p in out_dir.iterdir()),
    }


def verify_export(name: str) -> float:
    """hf-to-trainer, then trainer-to-hf; transformers loads the export: max-abs logits difference."""
    _, model_cls, _ = FIXTURES[name]
    src = OUT / name
    expected = np.load(src / "expected.npz")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, export = Path(tmp) / "ckpt", Path(tmp) / "export"
        for args in (
            ["hf-to-trainer", "--hf-dir", str(src), "--output-dir", str(ckpt)],
            ["trainer-to-hf", "--checkpoint", str(ckpt), "--output-dir", str(export)],
        ):
            subprocess.run([sys.executable, "-m", "trainer.convert", *args], check=True, cwd=OUT.parents[2])
        model = model_cls.from_pretrained(export, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(expected["input_ids"]).long()).logits.float().numpy()
    return float(np.abs(logits - expected["logits"]).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", action="append", choices=list(FIXTURES), help="default: every fixture")
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    names = args.only or list(FIXTURES)
    for i, name in enumerate(FIXTURES):  # each fixture's seed is its position, whichever are made
        if name in names:
            print(name, make(name, args.seed + i))
    for name in names:
        print(name, "export loads in transformers, max-abs logits diff:", verify_export(name))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
