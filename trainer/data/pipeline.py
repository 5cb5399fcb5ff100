"""One entry point for training data, whatever the source: synthetic or Grain over ArrayRecord."""

from __future__ import annotations

import dataclasses

from trainer.config.schema import DataConfig
from trainer.data.synthetic import SyntheticIterator


def make_train_iterator(
    cfg: DataConfig,
    *,
    vocab_size: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    stream: int = 0,
):
    """An iterator of this process's rows of each global batch, with get_state/set_state/close.

    Its state is global (independent of process_count), so a resumed run with a different number of
    loader processes continues the same global example order. `stream` tags a synthetic stream
    (0: training; EVAL_STREAM: the held-out one).
    """
    if cfg.dataset_type == "synthetic":
        return SyntheticIterator(
            vocab_size=vocab_size,
            seq_len=cfg.max_target_length,
            global_batch_size=global_batch_size,
            seed=cfg.data_shuffle_seed,
            process_index=process_index,
            process_count=process_count,
            stream=stream,
        )
    from trainer.data.grain_pipeline import make_arrayrecord_iterator

    return make_arrayrecord_iterator(
        cfg,
        vocab_size=vocab_size,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
    )


# The synthetic held-out stream's tag: its rows come from seeds no training row uses (trainer.data.synthetic).
EVAL_STREAM = 0xE7A1


def make_eval_iterator(
    cfg: DataConfig,
    eval_files: str,
    *,
    vocab_size: int,
    global_batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
):
    """The held-out set from its start, in a fixed order: the synthetic held-out stream, or one pass
    over `eval_files` (grain_eval_files) read with the training data's tokenizer, format and SFT mask.

    Its state is global like the training iterator's, so `set_state` of its first state rewinds it to
    the same tokens on any mesh and process count. Grain workers are not used: an evaluation rewinds
    the iterator, which would restart them every time.
    """
    held_out = cfg
    if cfg.dataset_type != "synthetic":
        held_out = dataclasses.replace(cfg, grain_train_files=eval_files, num_epoch=1, grain_worker_count=0)
    return make_train_iterator(
        held_out,
        vocab_size=vocab_size,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
        stream=EVAL_STREAM,
    )
