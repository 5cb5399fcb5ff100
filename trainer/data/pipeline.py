"""One entry point for training data, whatever the source: synthetic or Grain over ArrayRecord."""

from __future__ import annotations

from trainer.config.schema import DataConfig
from trainer.data.synthetic import SyntheticIterator


def make_train_iterator(
    cfg: DataConfig, *, vocab_size: int, global_batch_size: int, process_index: int = 0, process_count: int = 1
):
    """An iterator of this process's rows of each global batch, with get_state/set_state/close.

    Its state is global (independent of process_count), so a resumed run with a different number of
    loader processes continues the same global example order.
    """
    if cfg.dataset_type == "synthetic":
        return SyntheticIterator(
            vocab_size=vocab_size,
            seq_len=cfg.max_target_length,
            global_batch_size=global_batch_size,
            seed=cfg.data_shuffle_seed,
            process_index=process_index,
            process_count=process_count,
        )
    from trainer.data.grain_pipeline import make_arrayrecord_iterator

    return make_arrayrecord_iterator(
        cfg,
        vocab_size=vocab_size,
        global_batch_size=global_batch_size,
        process_index=process_index,
        process_count=process_count,
    )
