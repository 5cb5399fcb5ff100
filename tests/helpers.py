"""Small shared pieces for tests: a micro model config, a synthetic global batch, a fresh train state."""

from __future__ import annotations

import dataclasses

from trainer.config import load_config
from trainer.data.synthetic import SyntheticIterator

# A model that compiles in well under a second: 1 layer, d=32, vocab 128, sequence 16.
NANO_MODEL = [
    "model=qwen3-tiny",
    "base_num_decoder_layers=1",
    "base_emb_dim=32",
    "base_num_query_heads=2",
    "base_num_kv_heads=1",
    "head_dim=16",
    "base_mlp_dim=64",
    "vocab_size=128",
    "max_target_length=16",
]


def micro_config(*overrides: str):
    """A config whose model compiles in a second or two: 2 layers, d=64, vocab 256, sequence 16."""
    return load_config(
        "base.yml",
        [
            "model=qwen3-tiny",
            "base_num_decoder_layers=2",
            "base_emb_dim=64",
            "base_num_query_heads=4",
            "base_num_kv_heads=2",
            "head_dim=16",
            "base_mlp_dim=128",
            "vocab_size=256",
            "max_target_length=16",
            "per_device_batch_size=1",
            "remat_policy=none",
            "run_name=test",
            *overrides,
        ],
    )


def synthetic_batch(cfg, rows: int, step: int = 0):
    it = SyntheticIterator(
        vocab_size=cfg.model.vocab_size,
        seq_len=cfg.data.max_target_length,
        global_batch_size=rows,
        seed=cfg.data.data_shuffle_seed,
    )
    return it.batch_at(step)


def replace(cfg, section: str, **changes):
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **changes)})


def shard_records(directory) -> list[dict]:
    """Every JSON record of the ArrayRecord shards in `directory`, in shard order."""
    import json
    from pathlib import Path

    from array_record.python import array_record_module

    records = []
    for path in sorted(Path(directory).glob("*.arrayrecord")):
        reader = array_record_module.ArrayRecordReader(str(path))
        records += [json.loads(r) for r in reader.read(list(range(reader.num_records())))]
        reader.close()
    return records


def fresh_state_on_one_device(cfg):
    """(optimizer, fresh train state) of `cfg` on the first device, built as an attempt builds them."""
    import jax

    from trainer import model as qwen3
    from trainer.parallel.mesh import build_mesh
    from trainer.program.optim import learning_rate_schedule, make_optimizer
    from trainer.program.state import init_state, state_shardings

    mesh = build_mesh(cfg.mesh, [jax.devices()[:1]])
    schedule = learning_rate_schedule(cfg.optim, steps=cfg.train.steps)
    opt = make_optimizer(cfg.optim, qwen3.param_logical_axes(cfg.model), schedule=schedule)
    shardings, _ = state_shardings(cfg.model, cfg.mesh.logical_axis_rules, mesh, opt)
    return opt, init_state(cfg.model, opt, shardings, seed=cfg.train.init_weights_seed)


def loader_processes(cfg, processes: int, *, global_batch_size: int, state=None) -> list:
    """The ArrayRecord loaders of `processes` data processes, each resumed from `state` if given."""
    from trainer.data.grain_pipeline import make_arrayrecord_iterator

    loaders = [
        make_arrayrecord_iterator(
            cfg, vocab_size=32768, global_batch_size=global_batch_size, process_index=p, process_count=processes
        )
        for p in range(processes)
    ]
    if state is not None:
        for loader in loaders:
            loader.set_state(state)
    return loaders


def auto_periods(measure, events, **overrides):
    """An `AutoPeriods` of 1000 steps on 2 slices of 4 chips (snapshot_period=auto, no local tier,
    checkpoint_period 10,000, pause-and-resume) planning with the real planner; `overrides` replace any
    constructor argument (a `clock`, another `checkpoint`, `mtbf_per_chip_s`, ...)."""
    from trainer.config.schema import AUTO
    from trainer.elastic.periods import AutoPeriods
    from trainer.plan.auto import plan

    args = dict(
        snapshot=AUTO,
        local=0,
        checkpoint=10_000,
        steps=1000,
        slices=2,
        devices_per_slice=4,
        mode="pause_resume",
        mtbf_per_chip_s=50_000 * 3600.0,
        max_overhead=0.05,
        events=events,
        measure=measure,
        planner=plan,
    )
    return AutoPeriods(**{**args, **overrides})


def batch_layout_with_defaults(**given):
    """`trainer.program.layout.batch_layout` with every argument a test leaves out at the simplest setting:
    one slice, all of it active, one device and batch shard, one accumulation step, keep_global."""
    from trainer.program.layout import batch_layout

    args = {
        "accumulation_steps": 1,
        "num_slices": 1,
        "policy": "keep_global",
        "devices_per_slice": 1,
        "batch_shards": 1,
    } | given
    args.setdefault("active_slices", args["num_slices"])
    return batch_layout(**args)
