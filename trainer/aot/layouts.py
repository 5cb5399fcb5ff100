"""Compile the trainer's real train step for a TPU target, once per slice layout the run can be in.

The step is built by the same functions an attempt uses (`trainer.run.train_spec`,
`trainer.attempt.plan_slices`, `trainer.attempt.compile_step`): the same mesh over slices, logical
rules, optimizer, batch plan and micro-steps, remat and scan. Only the devices differ: compile-only
TPU devices from libtpu instead of live ones, so the state is abstract (ShapeDtypeStructs with their
shardings) and nothing is allocated.

Layouts: all slices, and with replica-resize (1 <= elastic_min_slice_count < num_slices) every
survivor count down to the minimum, planned with `elastic_resize_batch_policy` as a resize would.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax

from trainer import model as qwen3
from trainer.aot import analysis, hlo
from trainer.aot.topology import Target
from trainer.attempt import TrainSpec, compile_step, plan_slices
from trainer.config.schema import RunConfig
from trainer.run import train_spec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LayoutResult:
    """One compiled layout: its mesh, batch plan, memory, collectives and estimate (all per chip)."""

    label: str
    active_slices: int
    chips: int
    mesh: dict
    global_batch_size: int
    micro_steps: int
    lr_scale: float
    compile_s: float
    memory: analysis.Memory
    collectives: dict
    estimate: dict

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["memory"] = self.memory.as_dict()
        return out


def layout_slice_counts(cfg: RunConfig) -> list[int]:
    """All slices first, then each replica-resize survivor count (none for pause-and-resume)."""
    n, low = cfg.mesh.num_slices, cfg.elastic.elastic_min_slice_count
    return [n] + (list(range(n - 1, low - 1, -1)) if 1 <= low < n else [])


def compile_layout(spec: TrainSpec, slices: list[list], target: Target, *, label: str) -> LayoutResult:
    """Plan and compile the train step over `slices` (compile-only devices) and measure it."""
    plan = plan_slices(spec, slices)
    chips = plan.mesh.size
    t0 = time.perf_counter()
    try:
        compiled, _ = compile_step(spec, plan)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The compiler refuses a program that cannot fit HBM: that is the answer, not a failure.
        return _refused(label, slices, plan, analysis.out_of_memory(str(e), plan.abstract_state, target.chip))
    seconds = time.perf_counter() - t0
    found = hlo.collectives(compiled.as_text(), devices_per_slice=len(slices[0]), num_slices=len(slices))
    summary = hlo.summarize(found)
    length = spec.data.max_target_length
    tokens = plan.batch.global_batch_size * length
    model_flops = qwen3.training_flops_per_token(spec.model, length) * tokens / chips
    result = LayoutResult(
        label=label,
        active_slices=len(slices),
        chips=chips,
        mesh=dict(plan.mesh.shape),
        global_batch_size=plan.batch.global_batch_size,
        micro_steps=plan.batch.micro_steps,
        lr_scale=plan.batch.lr_scale,
        compile_s=round(seconds, 2),
        memory=analysis.memory(compiled, plan.abstract_state, target.chip),
        collectives=summary,
        estimate=analysis.roofline(
            hlo_cost=analysis.cost(compiled),
            collective_summary=summary,
            model_flops_per_chip=model_flops,
            chip=target.chip,
        ),
    )
    log.info(
        "event=compiled layout=%s chips=%d seconds=%.1f total_bytes=%d fits=%s",
        label,
        chips,
        seconds,
        result.memory.total,
        result.fits,
    )
    return result


def _refused(label: str, slices: list[list], plan, memory: analysis.Memory) -> LayoutResult:
    log.info("event=compiled layout=%s chips=%d refused=%s", label, plan.mesh.size, memory.compiler_error)
    return LayoutResult(
        label=label,
        active_slices=len(slices),
        chips=plan.mesh.size,
        mesh=dict(plan.mesh.shape),
        global_batch_size=plan.batch.global_batch_size,
        micro_steps=plan.batch.micro_steps,
        lr_scale=plan.batch.lr_scale,
        compile_s=0.0,
        memory=memory,
        collectives={},
        estimate={},
    )


def compile_layouts(cfg: RunConfig, slices: list[list], target: Target) -> list[LayoutResult]:
    """Every layout of `cfg` over the target's `slices`: all of them, then each replica-resize survivor
    count (the first k slices, as a resize keeps the surviving ones)."""
    spec, n = train_spec(cfg), len(slices)
    return [
        compile_layout(spec, slices[:k], target, label="all slices" if k == n else f"resize to {k} of {n} slices")
        for k in layout_slice_counts(cfg)
    ]
