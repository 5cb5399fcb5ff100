"""Llama 3 against a live transformers `LlamaForCausalLM` on generated cases: random models of several
shapes (tied and untied, one to all KV heads, head_dim given or derived, default RoPE and the llama3
scaling with different parameters) saved by transformers, converted, run here in float32: logits within
1e-4 of transformers', and the export holds the very tensors transformers saved and loads back in
transformers to the same logits.

The `interop` tier (torch and transformers; `.ci/run` installs them and runs `python -m pytest -m interop`);
without them it skips, when it runs (the import is inside the test: the default tier, which deselects it,
collects this file without them). The fixtures of tests/test_hf_interop.py cover the same contract
without torch.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.interop

LOGITS_ATOL = 1e-4
COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
COMMON.update(rms_norm_eps=1e-5, hidden_act="silu", max_position_embeddings=256)


def _llama3(factor: float, low: float, high: float, original: int, theta: float = 500_000.0) -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


CASES = {
    "tied-gqa-scaled": dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                            rope_parameters=_llama3(32.0, 1.0, 4.0, 64)),
    "untied-kv1-default-rope": dict(num_key_value_heads=1, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    "untied-mha-scaled": dict(num_key_value_heads=4, head_dim=8, tie_word_embeddings=False,
                              rope_parameters=_llama3(8.0, 1.0, 4.0, 16, theta=10_000.0)),
    "tied-three-layers-scaled": dict(num_key_value_heads=2, num_hidden_layers=3, tie_word_embeddings=True,
                                     rope_parameters=_llama3(2.0, 0.5, 3.0, 24)),
}  # fmt: skip


def _save_random_llama(path, kwargs: dict, seed: int) -> None:
    """A LlamaForCausalLM with norm weights ~ 1 + 0.3 N(0,1), embedding ~ 0.5 N(0,1), matrices ~ 0.12 N(0,1)
    (logits that differ clearly between tokens), saved as float32 safetensors."""
    import torch
    import transformers

    gen = torch.Generator().manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**COMMON, **kwargs})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else (0.5 if "embed_tokens" in name else 0.12) * noise)
    model.save_pretrained(path, safe_serialization=True)


def _torch_logits(path, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_llama_logits_match_transformers_and_the_export_round_trips(case, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file

    from trainer.hf.checkpoints import checkpoint_model_config, load_checkpoint_params
    from trainer.hf.logits import compute_logits
    from trainer.hf.to_hf import trainer_to_hf
    from trainer.hf.to_trainer import hf_to_trainer

    source = tmp_path / "hf"
    _save_random_llama(source, CASES[case], seed=sorted(CASES).index(case))
    ids = np.random.default_rng(0).integers(0, COMMON["vocab_size"], size=(2, 48))  # past the original contexts
    expected = _torch_logits(source, ids)

    ckpt = hf_to_trainer(source, tmp_path / "ckpt")
    cfg = checkpoint_model_config(ckpt)
    assert cfg.model_family == "llama3" and not cfg.use_qk_norm
    assert (cfg.rope_scaling == "none") == (CASES[case]["rope_parameters"]["rope_type"] == "default")
    logits = compute_logits(load_checkpoint_params(ckpt, cfg), cfg, ids)
    assert np.abs(logits - expected).max() <= LOGITS_ATOL

    export = trainer_to_hf(ckpt, tmp_path / "export")
    theirs, ours = load_file(str(source / "model.safetensors")), load_file(str(export / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    np.testing.assert_array_equal(_torch_logits(export, ids), expected)
