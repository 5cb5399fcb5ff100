"""A checkpoint opened for evaluation: its tokenizer, and a scorer and a greedy generator on the mesh.

`open_backend(path)` reads everything from the checkpoint (source.py), builds the mesh over the local
devices (placement.py), restores the params onto their training shardings and binds them to the two
device programs (scoring.py, greedy.py). The model runs as at inference (`for_inference`: MoE dropless,
no remat) in `dtype` activations: float32 by default, so scores compare with a float32 Hugging Face
model's. Nothing here imports lm-eval.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from trainer.evaluate.greedy import Generator
from trainer.evaluate.scoring import Scorer
from trainer.evaluate.source import Source, open_source
from trainer.evaluate.text import Text

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
CACHE_NAMES = {5: (None, "activation_batch", None, "activation_kv_heads", None), 0: ()}  # KVCache leaves


@dataclasses.dataclass(frozen=True)
class Backend:
    source: Source
    text: Text
    scorer: Scorer
    generator: Generator
    rows: int  # rows of every device batch
    max_length: int  # tokens of context the model is given (longer requests are cut from the left)


def open_backend(
    path,
    *,
    model: str | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    dtype: str = "float32",
    devices=None,
) -> Backend:
    """The checkpoint `path` names (source.py; `model` for one that records no config) ready to score and
    generate; `max_length` defaults to the run's max_target_length. Input problems are UserInputErrors,
    raised before any array is read."""
    from trainer.errors import UserInputError
    from trainer.evaluate.batching import batch_rows
    from trainer.evaluate.placement import eval_mesh, load_params, row_shards, rows_sharding
    from trainer.model.generation import for_inference

    if dtype not in DTYPES:
        raise UserInputError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if batch_size < 1:
        raise UserInputError(f"--batch-size {batch_size} must be >= 1")
    source = open_source(path, model)
    max_length = max_length or source.data.max_target_length
    if max_length < 2:
        raise UserInputError(f"--max-length {max_length} must be >= 2")
    text = Text(source.data.tokenizer_path, source.data.tokenizer_type, add_bos=source.data.add_bos)
    if text.eos_id is None:
        raise UserInputError(
            f"the checkpoint's tokenizer {source.data.tokenizer_path} has no EOS token (lm-eval needs one to "
            f"end generations); use a tokenizer with <|endoftext|>, </s> or <eos>"
        )
    rules = source.mesh.logical_axis_rules
    mesh = eval_mesh(source.mesh, devices or jax.devices())
    rows = batch_rows(batch_size, row_shards(mesh, rules))
    params = load_params(source.checkpoint, source.model, mesh, rules)
    cfg = for_inference(dataclasses.replace(source.model, dtype=dtype))

    def cache_sharding(cache):
        return jax.tree.map(lambda x: rows_sharding(mesh, rules, CACHE_NAMES[x.ndim], x.shape), cache)

    log.info("evaluating %s: %d rows per batch, max_length %d, %s", source.checkpoint, rows, max_length, dtype)
    return Backend(
        source=source,
        text=text,
        scorer=Scorer(params, cfg, mesh=mesh, rules=rules, rows=rows, max_length=max_length),
        generator=Generator(params, cfg, rows=rows, cache_sharding=cache_sharding),
        rows=rows,
        max_length=max_length,
    )
