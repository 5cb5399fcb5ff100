"""The logits command: float32 logits of token ids, from a checkpoint or a Hugging Face directory.

Reads the ids (a .npy integer array, never unpickled, or a text file of integer ids) and checks them
against the model's vocabulary before any weight is read; the model then runs in float32 and, if MoE,
dropless (as HF does), so the logits compare with transformers' whatever the training dtype.
"""

from __future__ import annotations

import dataclasses
import io
import re
from pathlib import Path

import numpy as np

from trainer.checkpoint.checks import check_checkpoint_dir
from trainer.errors import UserInputError
from trainer.hf.checkpoints import check_matches, checkpoint_model_config, load_checkpoint_params
from trainer.hf.errors import MissingInput, why
from trainer.hf.load import open_hf, read_hf_params
from trainer.hf.outputs import check_output
from trainer.io.paths import resolve
from trainer.io.staging import staged_file

_NPY_MAGIC = b"\x93NUMPY"


class InputError(UserInputError):
    """Token ids the model cannot take (unreadable, empty, wrong rank, dtype or range)."""


def read_input_ids(path) -> np.ndarray:
    """Token ids [batch, seq] (int64) from `path`: a .npy integer array [batch, seq] or [seq], or a text file
    of integer ids separated by whitespace or commas, one sequence per line (all the same length). The
    format is told by the content (a .npy starts with its magic bytes), not the name. Never unpickles."""
    path = resolve(path)
    if not path.is_file():
        raise MissingInput(
            f"--input-ids {path} does not exist"
            if not path.exists()
            else f"--input-ids {path} is a directory; give a .npy or text file of token ids"
        )
    data = path.read_bytes()
    if data.startswith(_NPY_MAGIC):
        try:
            ids = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise InputError(
                f"--input-ids {path} is not a readable .npy array ({why(e)}); save the ids "
                f"with np.save(path, np.asarray(ids, np.int32))"
            ) from None
    elif path.suffix == ".npy":
        raise InputError(
            f"--input-ids {path} is not a .npy file (no NumPy header); save it with np.save, "
            f"or give a text file of integer ids"
        )
    else:
        ids = _text_ids(data, path)
    if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(
            f"--input-ids {path}: token ids must be integers [batch, seq] or [seq], got "
            f"{ids.dtype} {list(ids.shape)}"
        )
    if ids.size == 0:
        raise InputError(f"--input-ids {path} is empty: no token ids (shape {list(ids.shape)}); give at least one")
    return (ids[None] if ids.ndim == 1 else ids).astype(np.int64)


def _text_ids(data: bytes, path) -> np.ndarray:
    expected = (
        "expected a .npy integer array, or text with integer ids separated by spaces or commas, "
        "one sequence per line"
    )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"--input-ids {path} is neither a .npy file nor text; {expected}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        tokens = [t for t in re.split(r"[\s,]+", line.strip()) if t]
        if not tokens:
            continue
        try:
            row = [int(t) for t in tokens]
        except ValueError:
            bad = next(t for t in tokens if not re.fullmatch(r"[+-]?\d+", t))
            raise InputError(
                f"--input-ids {path} line {n}: {bad!r} is not an integer token id; {expected}"
            ) from None
        if rows and len(row) != len(rows[0][1]):
            raise InputError(
                f"--input-ids {path} line {n} has {len(row)} ids but line {rows[0][0]} has "
                f"{len(rows[0][1])}: the sequences form one batch, so they must be the same length"
            )
        rows.append((n, row))
    if not rows:
        raise InputError(f"--input-ids {path} is empty: no token ids; {expected}")
    try:
        return np.asarray([row for _, row in rows], np.int64)
    except OverflowError:
        raise InputError(f"--input-ids {path}: a token id does not fit in 64 bits") from None


def check_ids(ids: np.ndarray, vocab_size: int, source: str = "input ids") -> None:
    """Ids the model can take: non-empty integers [batch, seq] in [0, vocab_size)."""
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{source} must be integers [batch, seq] or [seq], got {ids.dtype} {list(ids.shape)}")
    if ids.size == 0:
        raise InputError(f"{source} are empty (shape {list(ids.shape)}); give at least one token id")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InputError(
            f"{source} must be in [0, {vocab_size}) (the model's vocab_size), got [{ids.min()}, {ids.max()}]"
        )


def compute_logits(params: dict, cfg, input_ids: np.ndarray) -> np.ndarray:
    """float32 logits [B, T, V] of int ids [B, T]: float32 activations, MoE dropless."""
    import jax
    import jax.numpy as jnp

    from trainer.model import forward, logits_from_hidden
    from trainer.model.generation import for_inference

    cfg = for_inference(dataclasses.replace(cfg, dtype="float32"))
    ids = np.asarray(input_ids)
    ids = ids[None] if ids.ndim == 1 else ids
    check_ids(ids, cfg.vocab_size)
    ids = jnp.asarray(ids, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)

    @jax.jit
    def run(p, tokens):
        hidden, _ = forward(p, cfg, tokens, positions, jnp.ones_like(tokens))
        return logits_from_hidden(p, cfg, hidden)

    return np.asarray(run(params, ids), np.float32)


def logits_command(
    *, ckpt=None, hf_dir=None, model: str | None = None, input_ids, output, overwrite: bool = False
) -> Path:
    """Write the float32 logits of the ids in `input_ids` to the .npy `output`; returns its path. The ids,
    the output and the model source are checked before any weight is read."""
    output = check_output(output, overwrite=overwrite, flag="--output", inputs=[input_ids, ckpt, hf_dir])
    ids = read_input_ids(input_ids)
    if hf_dir is not None:
        cfg, reader, plan = open_hf(resolve(hf_dir), dtype="float32", weight_dtype="float32")
        check_ids(ids, cfg.vocab_size, f"--input-ids {resolve(input_ids)}")
        params = read_hf_params(reader, plan, "float32")
    else:
        ckpt = check_checkpoint_dir(ckpt)
        cfg = checkpoint_model_config(ckpt, model)
        check_ids(ids, cfg.vocab_size, f"--input-ids {resolve(input_ids)}")
        check_matches(ckpt, cfg, model)
        params = load_checkpoint_params(ckpt, cfg)
    logits = compute_logits(params, cfg, ids)
    with staged_file(output, overwrite=overwrite) as tmp, open(tmp, "wb") as f:
        np.save(f, logits)  # a file object: np.save would append .npy to a path
    return output
