"""elastic_resize_bitwise: a train step has the same bits on any number of data-parallel replicas.

The step's gradient is summed as fixed groups of rows in their order (`trainer.program.step.ordered_sums`,
`trainer.program.layout.ordered_groups`), so the same state and batch give the same new state and metrics,
bit for bit, on all slices and on the survivors of a replica-resize. Without the key the survivors' sums
are grouped differently and the bits differ (the contrast below shows the comparison can fail)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import NANO_MODEL, batch_layout_with_defaults

from trainer.config import ConfigError, load_config
from trainer.data.pipeline import make_train_iterator
from trainer.parallel.mesh import group_into_slices
from trainer.program.layout import lower_step, ordered_groups, slice_layout, train_spec
from trainer.program.state import init_base, init_state

STEPS = 3


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _run(overrides: list[str], active: int, devices_per_slice: int = 1) -> tuple[list[bytes], list[bytes]]:
    """(state bits, metrics bits) after STEPS train steps on `active` of the config's slices, every count
    starting from the same initial state and reading the same batches."""
    cfg = load_config("base.yml", [*NANO_MODEL, *overrides])
    spec = train_spec(cfg)
    devices = jax.devices()[: cfg.mesh.num_slices * devices_per_slice]
    slices = group_into_slices(devices, cfg.mesh.num_slices)[:active]
    layout = slice_layout(spec, slices)
    step = lower_step(spec, layout, "train").compile()
    state = init_state(spec.model, layout.optimizer, layout.shardings, seed=0, lora=spec.lora)
    base = () if layout.base_shardings is None else (init_base(spec.model, layout.base_shardings, seed=1),)
    iterator = make_train_iterator(
        spec.data, vocab_size=spec.model.vocab_size, global_batch_size=layout.batch.global_batch_size
    )
    metrics = []
    for _ in range(STEPS):
        host = next(iterator)
        batch = {k: jax.make_array_from_process_local_data(layout.batch_sharding, v) for k, v in host.items()}
        state, m = step(state, batch, *base)
        metrics.append(m)
    iterator.close()
    return _bits(state), _bits(metrics)


THREE_SLICES = ["num_slices=3", "elastic_enabled=true", "elastic_min_slice_count=1", "per_device_batch_size=2"]


# A survivor set of one CPU device is left out: its program is compiled without partitioning and XLA:CPU
# fuses the attention's backward differently there (docs/elastic.md says so).
@pytest.mark.parametrize(
    "extra, devices_per_slice, survivors",
    [
        ([], 1, (2,)),
        (["gradient_accumulation_steps=2"], 1, (2,)),
        (["ici_fsdp_parallelism=2"], 2, (2, 1)),
        (
            ["num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=32", "load_balance_loss_weight=0.01"],
            1,
            (2,),
        ),
        (["lora_rank=4"], 1, (2,)),
    ],
    ids=["plain", "accumulation", "fsdp", "moe", "lora"],
)
def test_the_step_has_the_same_bits_on_every_replica_count(extra, devices_per_slice, survivors):
    overrides = [*THREE_SLICES, "elastic_resize_bitwise=true", *extra]
    full = _run(overrides, 3, devices_per_slice)
    for active in survivors:
        assert _run(overrides, active, devices_per_slice) == full, f"{active} of 3 slices"


def test_without_the_key_the_survivors_step_differs_in_its_bits():
    full = _run(THREE_SLICES, 3)
    assert _run(THREE_SLICES, 2)[0] != full[0]


def test_groups_are_the_fewest_every_feasible_replica_count_divides():
    assert ordered_groups(units=6, nominal_groups=3, replica_counts=(1, 2, 3)) == 6
    assert ordered_groups(units=8, nominal_groups=4, replica_counts=(2, 3, 4)) == 4  # 3 cannot split 8 rows
    assert ordered_groups(units=12, nominal_groups=8, replica_counts=(4,)) == 8
    layout = batch_layout_with_defaults(
        per_device_batch_size=2, num_slices=3, active_slices=2, batch_shards=2, bitwise_resize=True
    )
    assert (layout.global_batch_size, layout.micro_steps, layout.ordered_groups) == (6, 3, 6)


def test_the_key_needs_keep_global():
    with pytest.raises(ConfigError, match="elastic_resize_batch_policy=keep_global"):
        load_config("base.yml", ["elastic_resize_bitwise=true", "elastic_resize_batch_policy=scale"])
