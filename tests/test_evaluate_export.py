"""trainer-to-hf exports the checkpoint's tokenizer where transformers loads it to the same token ids, which
lm-eval's Hugging Face backend needs to score an export as `python -m trainer.evaluate` scores the
checkpoint: the run's tokenizer.json unchanged, a tokenizer_config.json naming the plain fast-tokenizer
class and the trainer's special tokens, and their ids in config.json. A sentencepiece model is left out,
with a warning that says why. (That transformers then tokenizes and scores alike:
tests/test_evaluate_interop.py.)"""

from __future__ import annotations

import json
import logging

from eval_checkpoint import TOKENIZER, write_checkpoint

from trainer.hf.to_hf import trainer_to_hf


def test_a_huggingface_tokenizer_is_exported_with_its_class_and_special_tokens(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt", tokenizer_path=str(TOKENIZER), tokenizer_type="huggingface")
    out = trainer_to_hf(ckpt, tmp_path / "hf")
    assert (out / "tokenizer.json").read_bytes() == TOKENIZER.read_bytes()
    assert json.loads((out / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "bos_token": None,
        "pad_token": "<|pad|>",
        "clean_up_tokenization_spaces": False,
    }
    config = json.loads((out / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"]) == (0, 1) and "bos_token_id" not in config


def test_a_sentencepiece_tokenizer_is_left_out_with_a_warning(tmp_path, caplog):
    ckpt = write_checkpoint(tmp_path / "ckpt")  # base.yml's tokenizer: data/tokenizer/fc_sp8k.model
    with caplog.at_level(logging.WARNING, logger="trainer.hf.tokenizer_export"):
        out = trainer_to_hf(ckpt, tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "eos_token_id" not in json.loads((out / "config.json").read_text())
    assert "tokenizer not exported: the checkpoint's tokenizer is sentencepiece" in caplog.text


def test_a_missing_tokenizer_file_is_left_out_with_a_warning_not_an_error(tmp_path, caplog):
    ckpt = write_checkpoint(
        tmp_path / "ckpt", tokenizer_path=str(tmp_path / "gone.json"), tokenizer_type="huggingface"
    )
    with caplog.at_level(logging.WARNING, logger="trainer.hf.tokenizer_export"):
        out = trainer_to_hf(ckpt, tmp_path / "hf")
    assert not (out / "tokenizer.json").exists()
    assert "tokenizer not exported" in caplog.text and "gone.json" in caplog.text
