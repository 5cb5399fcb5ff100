"""LoRA export against PEFT and transformers: a LoRA run over an imported Hugging Face model, its adapters
exported with `lora-to-peft` and loaded by `peft.PeftModel` over that same model, and its merged
`trainer-to-hf` export loaded by transformers, each give this trainer's float32 logits within 1e-4.

The `interop` tier (needs the peft extra with torch + transformers; `.ci/run` installs them and runs
pytest -m interop).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cli_harness import cli_env

pytestmark = [pytest.mark.interop, pytest.mark.slow]

FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "dense_untied_kv1"
ATOL = 1e-4


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """hf-to-trainer of the fixture, then 3 LoRA steps over it (rank 4, all projections): the newest step."""
    from trainer.hf.to_trainer import hf_to_trainer

    root = tmp_path_factory.mktemp("lora")
    base = hf_to_trainer(FIXTURE, root / "base")
    cmd = [
        sys.executable,
        "-m",
        "trainer.train",
        "base.yml",
        f"model={base / 'model.yml'}",
        f"load_parameters_path={base}",
        "dataset_type=synthetic",
        "dtype=float32",
        "max_target_length=16",
        "per_device_batch_size=2",
        "lora_rank=4",
        "lora_alpha=8",
        "learning_rate=1e-2",
        "warmup_steps_fraction=0",
        "steps=3",
        "enable_tensorboard=false",
        f"base_output_directory={root}",
        "run_name=r",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env(1))
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "r" / "checkpoints" / "3"


def _ids() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 100, size=(2, 12)).astype(np.int64)


def _ours(ckpt) -> np.ndarray:
    from trainer.hf.logits import compute_logits
    from trainer.hf.lora_export import lora_run_config, merged_params

    run = lora_run_config(ckpt)
    return compute_logits(merged_params(ckpt, run), run.model, _ids())


def test_peft_loads_the_adapters_with_equal_logits(lora_run, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer.hf.lora_export import lora_to_peft

    out = lora_to_peft(lora_run, tmp_path / "adapter")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    base = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out).eval()
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 7 and any(float(p.abs().max()) > 0 for p in lora_b)  # trained, not the zero init
    with torch.no_grad():
        theirs = model(torch.from_numpy(_ids())).logits.numpy()
    np.testing.assert_allclose(_ours(lora_run), theirs, atol=ATOL, rtol=0)


def test_merged_export_loads_in_transformers_with_equal_logits(lora_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.hf.to_hf import trainer_to_hf

    out = trainer_to_hf(lora_run, tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.from_numpy(_ids())).logits.numpy()
        before = base(torch.from_numpy(_ids())).logits.numpy()
    ours = _ours(lora_run)
    np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
    assert np.abs(theirs - before).max() > 10 * ATOL  # the adapters changed the model
