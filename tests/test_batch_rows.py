"""A fractional per_device_batch_size: whole sequences per slice, counted exactly, or a named refusal."""

import jax
import pytest
from helpers import batch_layout_with_defaults, micro_config

from trainer.errors import ConfigError
from trainer.parallel.mesh import group_into_slices
from trainer.program.batch_rows import rows_per_slice
from trainer.program.layout import BatchLayout, slice_layout, train_spec


@pytest.mark.parametrize(
    "value, devices, shards, rows",
    [(2, 8, 8, 16), (0.5, 4, 2, 2), (0.25, 4, 1, 1), (0.125, 8, 1, 1), (0.375, 8, 1, 3), (1 / 3, 3, 1, 1)],
)
def test_rows_per_slice_is_an_exact_whole_count(value, devices, shards, rows):
    got = rows_per_slice(value, devices_per_slice=devices, shards_per_slice=shards)
    assert got == rows and type(got) is int


def test_a_fraction_that_is_not_whole_sequences_names_the_key_the_devices_and_the_smallest_fraction():
    with pytest.raises(ConfigError) as info:
        rows_per_slice(0.3, devices_per_slice=8, shards_per_slice=1)
    assert str(info.value) == (
        "per_device_batch_size=0.3 x 8 devices per slice is 2.4 sequences: use a multiple of 0.125 "
        "(1 sequence per device group of 8)"
    )


def test_a_fraction_that_does_not_split_over_the_batch_shards_is_refused_with_the_smallest_fraction():
    # context 2 x fsdp 2 on 4 devices: 2 batch shards, so 0.25 x 4 = 1 sequence cannot be split
    with pytest.raises(ConfigError) as info:
        rows_per_slice(0.25, devices_per_slice=4, shards_per_slice=2, key="eval_per_device_batch_size")
    message = str(info.value)
    assert message.startswith("eval_per_device_batch_size=0.25 x 4 devices per slice is 1 sequence")
    assert "2 batch shards" in message and "use a multiple of 0.5 (1 sequence per device group of 2)" in message


def test_batch_layout_counts_a_fractional_batch_exactly():
    layout = batch_layout_with_defaults(
        per_device_batch_size=0.125, accumulation_steps=3, num_slices=2, devices_per_slice=8, batch_shards=2
    )
    assert layout == BatchLayout(6, 3, 1.0) and type(layout.global_batch_size) is int
    dpo = batch_layout_with_defaults(
        per_device_batch_size=0.5, devices_per_slice=4, batch_shards=2, rows_per_example=2, shards_per_slice=2
    )
    assert dpo == BatchLayout(4, 1, 1.0)


def test_batch_layout_refuses_an_unsplittable_batch_without_a_search_past_it():
    with pytest.raises(ValueError, match="global batch 3 cannot be split evenly over 2 batch shards"):
        batch_layout_with_defaults(per_device_batch_size=3, batch_shards=2)


def _layout(*overrides: str, slices: int = 1):
    cfg = micro_config("ici_fsdp_parallelism=-1", f"num_slices={slices}", *overrides)
    return slice_layout(train_spec(cfg), group_into_slices(jax.devices()[:4], slices))


def test_half_a_sequence_per_device_under_context_parallelism_two_is_one_sequence_per_context_group():
    layout = _layout("ici_context_parallelism=2", "per_device_batch_size=0.5")
    assert layout.batch.global_batch_size == 2 and type(layout.batch.global_batch_size) is int
    assert layout.batch.micro_steps == 1


def test_a_fraction_finer_than_the_context_groups_is_a_config_error_before_compiling():
    with pytest.raises(ConfigError, match=r"per_device_batch_size=0.25 x 4 devices per slice is 1 sequence"):
        _layout("ici_context_parallelism=2", "per_device_batch_size=0.25")
    eval_message = r"eval_per_device_batch_size=0.3 x 4 devices per slice is 1.2 sequences"
    with pytest.raises(ConfigError, match=eval_message):
        _layout(
            "ici_context_parallelism=2",
            "per_device_batch_size=0.5",
            "eval_interval=1",
            "eval_steps=1",
            "eval_per_device_batch_size=0.3",
        )


def test_on_two_slices_a_fraction_counts_the_batch_shards_of_one_slice():
    """2 slices of 2 devices, context 2: each slice is one context group, so 0.5 is one sequence a slice
    (the data axis spans the slices; a slice's own batch shards are 1)."""
    layout = _layout("ici_context_parallelism=2", "per_device_batch_size=0.5", slices=2)
    assert (layout.batch.global_batch_size, layout.batch.micro_steps) == (2, 1)
