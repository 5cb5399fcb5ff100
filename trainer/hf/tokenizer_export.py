"""The tokenizer of a trainer-to-hf export: files transformers loads to the same token ids as the trainer.

A checkpoint trained with a Hugging Face tokenizer.json (tokenizer_type=huggingface, which an hf-to-trainer
output that carried one records in its model.yml) exports that file unchanged, plus a tokenizer_config.json
that makes `AutoTokenizer` load it as a plain `PreTrainedTokenizerFast` (transformers 4.x and 5.x). Without
that file transformers picks its Qwen2 tokenizer class for model_type qwen3, which in 5.x builds its own
pre-tokenizer around the vocabulary and splits text differently (digits one by one). The special tokens
named there are the trainer's own (trainer/data/tokenizer.py: EOS, BOS and padding, by content); their ids
go into config.json too, so that `generate` stops at the EOS the trainer's decoding stops at.

A sentencepiece model is not exported: transformers converts a .model with rules of its own that are not
guaranteed to split text as sentencepiece does, and a tokenizer that splits differently would score a
different model. The export logs that it left the tokenizer out, and why.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

CONFIG_IDS = {"eos": "eos_token_id", "bos": "bos_token_id", "pad": "pad_token_id"}


def _source(data, ckpt: Path) -> Path | None:
    """The tokenizer.json to export, or None (logged) when the checkpoint's tokenizer has none."""
    from trainer.data.errors import DataError
    from trainer.data.tokenizer import resolve_asset_path

    if data.tokenizer_type == "huggingface":
        try:
            path = resolve_asset_path(data.tokenizer_path)
        except (DataError, OSError) as e:
            log.warning("tokenizer not exported: %s", e)
            return None
        if path.is_file():
            return path
        log.warning(
            "tokenizer not exported: the checkpoint's tokenizer_path=%s is not a file here", data.tokenizer_path
        )
        return None
    if (ckpt / "tokenizer.json").is_file():  # an hf-to-trainer output whose model.yml was edited
        return ckpt / "tokenizer.json"
    log.warning(
        "tokenizer not exported: the checkpoint's tokenizer is sentencepiece (%s), which transformers "
        "converts with rules of its own; train with tokenizer_type=huggingface and a tokenizer.json to "
        "export one that transformers loads to the same token ids",
        data.tokenizer_path,
    )
    return None


def export_tokenizer(data, ckpt: Path, staging: Path) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json of the checkpoint's tokenizer (DataConfig `data`) into
    `staging`; returns the config.json ids of its special tokens ({} when nothing was exported)."""
    import tokenizers

    from trainer.data.tokenizer import Tokenizer

    source = _source(data, ckpt)
    if source is None:
        return {}
    ours = Tokenizer(source, "huggingface")
    raw = tokenizers.Tokenizer.from_file(str(source))
    ids = {"eos": ours.eos_id, "bos": ours.bos_id, "pad": ours.pad_id}
    pieces = {name: None if i is None else raw.id_to_token(i) for name, i in ids.items()}
    (staging / "tokenizer.json").write_bytes(source.read_bytes())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{name}_token": piece for name, piece in pieces.items()},
        "clean_up_tokenization_spaces": False,  # decode as the tokenizer.json's decoder does, as ours does
    }
    (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if data.add_bos and ids["bos"] is not None:
        log.warning(
            "the run prepends BOS (add_bos=true) but the exported tokenizer.json adds no special tokens "
            "itself: prepend %r to texts given to transformers",
            pieces["bos"],
        )
    return {CONFIG_IDS[name]: i for name, i in ids.items() if i is not None}
