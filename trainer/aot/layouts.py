"""Compile the trainer's real train step for a TPU target, once per slice layout the run can be in.

The step is built by the same functions an attempt uses, all in `trainer.program.layout` (`train_spec`,
`slice_layout`, `compile_step`): the same mesh over slices, logical rules, optimizer, batch layout and
micro-steps, remat and scan. Only the devices differ: compile-only TPU devices from libtpu instead of
live ones, so the state is abstract (ShapeDtypeStructs with their shardings) and nothing is allocated.

Layouts: all slices, and with replica-resize (1 <= elastic_min_slice_count < num_slices) every
survivor count down to the minimum, planned with `elastic_resize_batch_policy` as a resize would.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import jax

from trainer import model
from trainer.aot import analysis, context, hlo
from trainer.aot.topology import Target, topology_devices
from trainer.config.schema import RunConfig
from trainer.io.nbytes import tree_nbytes
from trainer.logevents import event_extra
from trainer.model import attention
from trainer.parallel.mesh import group_into_slices
from trainer.program.layout import TrainSpec, compile_step, slice_layout, train_spec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LayoutResult:
    """One compiled layout: its mesh, batch layout, memory, collectives and estimate (all per chip)."""

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
    state_bytes: int = 0  # the whole train state (params + optimizer), all chips together: what a restore moves
    attention: str = ""  # the kernel the model resolved for the target (splash, flash, ...)
    # The eval step on the same mesh (eval_interval > 0), {} when eval is off: its compile time and
    # per-chip bytes while it runs next to the resident train state.
    eval: dict = dataclasses.field(default_factory=dict)
    largest_collectives: list = dataclasses.field(default_factory=list)  # hlo.largest: per step and chip
    # The sequence split over the context axis (context.context_split), {} without context parallelism.
    context: dict = dataclasses.field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory.fits and self.eval.get("fits", True)

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
    layout = slice_layout(spec, slices)
    chips = layout.mesh.size
    t0 = time.perf_counter()
    try:
        compiled, _ = compile_step(spec, layout, "train")
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        # The compiler refuses a program that cannot fit HBM: that is the answer, not a failure.
        refused = analysis.out_of_memory(str(e), layout.abstract_state, target.chip)
        return _refused(label, slices, layout, refused, spec)
    seconds = time.perf_counter() - t0
    eval_report = _compile_eval(spec, layout, target) if layout.eval_batch is not None else {}
    found = hlo.collectives(compiled.as_text(), devices_per_slice=len(slices[0]), num_slices=len(slices))
    summary = hlo.summarize(found)
    length = spec.data.max_target_length
    tokens = layout.batch.global_batch_size * length
    model_flops = model.training_flops_per_token(spec.model, length) * tokens / chips
    recompute_flops = model.recompute_flops_per_token(spec.model, length) * tokens / chips
    memory = analysis.memory(compiled, layout.abstract_state, target.chip)
    result = LayoutResult(
        label=label,
        active_slices=len(slices),
        chips=chips,
        mesh=dict(layout.mesh.shape),
        global_batch_size=layout.batch.global_batch_size,
        micro_steps=layout.batch.micro_steps,
        lr_scale=layout.batch.lr_scale,
        compile_s=round(seconds, 2),
        memory=memory,
        collectives=summary,
        estimate=analysis.roofline(
            hlo_cost=analysis.cost(compiled),
            collective_summary=summary,
            model_flops_per_chip=model_flops,
            recompute_flops_per_chip=recompute_flops,
            state_bytes_per_chip=memory.params + memory.optimizer,
            chip=target.chip,
        ),
        state_bytes=tree_nbytes(layout.abstract_state),
        attention=_attention_kernel(spec, target),
        eval=eval_report,
        largest_collectives=hlo.largest(found),
        context=_context(spec, layout),
    )
    log.info(
        "compiled %s on %d chips in %.1f s: %d bytes per chip, %s",
        label,
        chips,
        seconds,
        result.memory.total,
        "fits" if result.fits else "does not fit",
        extra=event_extra(
            "compiled",
            {
                "layout": label,
                "chips": chips,
                "seconds": seconds,
                "total_bytes": result.memory.total,
                "fits": result.fits,
            },
        ),
    )
    return result


def _context(spec: TrainSpec, layout) -> dict:
    return context.context_split(
        spec,
        chips=layout.mesh.size,
        global_batch_size=layout.batch.global_batch_size,
        micro_steps=layout.batch.micro_steps,
        backend="tpu",
    )


def _attention_kernel(spec: TrainSpec, target: Target) -> str:
    """The attention computation the model runs on the target's chips (as the trace resolved it): the
    kernel, or under context parallelism what runs on the split sequence (context.kernel_under_context)."""
    if spec.mesh.ici_context_parallelism > 1:
        return context.kernel_under_context(spec, backend="tpu")
    m = spec.model
    return attention.resolve(
        m.attention, backend="tpu", seq_len=spec.data.max_target_length, head_dim=m.head_dim, dtype=m.dtype
    )


def _compile_eval(spec: TrainSpec, layout, target: Target) -> dict:
    """Compile the eval step next to the train step. While it runs the whole train state stays in HBM,
    so its per-chip total counts the optimizer state too (the eval step takes only the params)."""
    t0 = time.perf_counter()
    try:
        compiled, _ = compile_step(spec, layout, "eval")
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"fits": False, "compiler_error": str(e).strip().splitlines()[0][:500]}
    stats = compiled.memory_analysis()
    optimizer = analysis.shard_bytes(layout.abstract_state["opt_state"])
    total = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        + stats.generated_code_size_in_bytes
        + optimizer
    )
    return {
        "compile_s": round(time.perf_counter() - t0, 2),
        "global_batch_size": layout.eval_batch.global_batch_size,
        "micro_steps": layout.eval_batch.micro_steps,
        "temporaries": int(stats.temp_size_in_bytes),
        "total": int(total),
        "fits": total <= target.chip.hbm_bytes,
    }


def _refused(label: str, slices: list[list], layout, memory: analysis.Memory, spec: TrainSpec) -> LayoutResult:
    log.info(
        "compiled %s on %d chips: refused (%s)",
        label,
        layout.mesh.size,
        memory.compiler_error,
        extra=event_extra(
            "compiled", {"layout": label, "chips": layout.mesh.size, "refused": memory.compiler_error}
        ),
    )
    return LayoutResult(
        label=label,
        active_slices=len(slices),
        chips=layout.mesh.size,
        mesh=dict(layout.mesh.shape),
        global_batch_size=layout.batch.global_batch_size,
        micro_steps=layout.batch.micro_steps,
        lr_scale=layout.batch.lr_scale,
        compile_s=0.0,
        memory=memory,
        collectives={},
        estimate={},
        context=_context(spec, layout),
    )


def survivor_slices(target: Target, k: int) -> list[list]:
    """The devices of k slices of the target, grouped by slice.

    A topology of exactly k slices, not k slices picked out of the full one: the multi-slice compiler
    expects every slice of the topology it was given (libtpu 0.0.42 aborts with SIGILL lowering a
    cross-slice all-reduce over 2 slices of a 3-slice topology). Device ids are assigned the same way,
    so the k-slice mesh matches the survivors' up to which slices survived."""
    return group_into_slices(topology_devices(dataclasses.replace(target, num_slices=k)), k)


def compile_layouts(cfg: RunConfig, target: Target) -> list[LayoutResult]:
    """Every layout of `cfg` on the target: all its slices, then each replica-resize survivor count."""
    spec, n = train_spec(cfg), target.num_slices
    results = []
    for k in layout_slice_counts(cfg):
        label = "all slices" if k == n else f"resize to {k} of {n} slices"
        results.append(compile_layout(spec, survivor_slices(target, k), target, label=label))
    return results
