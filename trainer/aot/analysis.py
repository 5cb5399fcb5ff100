"""What one compiled step costs a chip: memory against its HBM, and a roofline step time with its MFU.

Memory comes from the compiler (`Compiled.memory_analysis()`, per device): arguments (train state and
batch), outputs, the donated part they share, and temporaries (activations, gradients, the compiler's
scratch). Parameter and optimizer-state bytes per chip are also computed from the state's shardings,
and again in the compiled layouts with their tile padding, so the compiler's figure can be checked
against the analytic one.

The step-time estimate is a roofline, a lower bound: the slowest of compute, HBM traffic and the
collectives' per-chip traffic at the ICI and DCN bandwidths, assuming each overlaps the others
perfectly. The compiler's own counts (`cost_analysis`) leave out Pallas kernels and count a scanned
layer's body once, so each term has an analytic floor: compute at least the model's FLOPs plus the
rematerialised forward, HBM traffic at least reading and writing the train state once (the update).
MFU is the model's analytic FLOPs (trainer/model/flops.py, no rematerialisation) over that time at
the peak, so it is an upper bound on what a run reaches.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import numpy as np

from trainer.aot.topology import ChipSpec


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard, as XLA pads)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return int(total)


def tiled_bytes(shape, itemsize: int, layout) -> int:
    """Bytes of one array in a device layout: its minor dimensions padded to whole tiles (a TPU tile of
    a float32 array is 8 x 128, so a head_dim of 64 in the minor dimension takes twice its size)."""
    tiling = getattr(layout, "tiling", None)
    order = getattr(layout, "major_to_minor", None)
    if not tiling or order is None or len(order) != len(shape):
        return math.prod(shape) * itemsize
    dims = [shape[i] for i in order]  # major to minor
    for k, tile in enumerate(reversed(tiling[0])):
        i = len(dims) - 1 - k
        if i < 0:
            break
        dims[i] = -(-dims[i] // tile) * tile
    return math.prod(dims) * itemsize


def state_tiled_bytes(compiled, abstract_state) -> int | None:
    """Parameters and optimizer state one chip holds in the compiled step's input layouts (tile padding
    included); None where the executable does not say its layouts."""
    try:
        formats = compiled.input_formats[0][0]  # the state argument's, in the state's tree structure
        pairs = [
            pair
            for key in ("params", "opt_state")
            for pair in zip(
                jax.tree.leaves(abstract_state[key]),
                jax.tree.leaves(formats[key], is_leaf=lambda x: hasattr(x, "layout")),
                strict=True,
            )
        ]
    except Exception:
        return None
    total = 0
    for leaf, fmt in pairs:
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += tiled_bytes(shape, np.dtype(leaf.dtype).itemsize, fmt.layout)
    return int(total)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per chip."""

    params: int  # analytic, from the shardings
    optimizer: int  # analytic
    arguments: int  # compiler: state + batch in
    outputs: int
    aliased: int  # donated state reused for the output
    temporaries: int
    code: int
    hbm: int
    # Set when the compiler refused the program for HBM (RESOURCE_EXHAUSTED): its message, and the
    # bytes it said were required; the compiler's own figures above are then 0.
    compiler_error: str | None = None
    required: int | None = None
    # params + optimizer in the compiled layouts, tile padding included (None: layouts unknown); the
    # compiler's `arguments` are this plus the batch.
    state_tiled: int | None = None

    @property
    def total(self) -> int:
        if self.compiler_error is not None:
            return self.required if self.required is not None else self.hbm + 1
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code

    @property
    def fits(self) -> bool:
        return self.compiler_error is None and self.total <= self.hbm

    def as_dict(self) -> dict:
        return dataclasses.asdict(self) | {
            "total": self.total,
            "fits": self.fits,
            "fraction_of_hbm": self.total / self.hbm,
        }


def memory(compiled, abstract_state, chip: ChipSpec) -> Memory:
    stats = compiled.memory_analysis()
    return Memory(
        params=shard_bytes(abstract_state["params"]),
        optimizer=shard_bytes(abstract_state["opt_state"]),
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
        temporaries=int(stats.temp_size_in_bytes),
        code=int(stats.generated_code_size_in_bytes),
        hbm=chip.hbm_bytes,
        state_tiled=state_tiled_bytes(compiled, abstract_state),
    )


_SIZE = re.compile(r"\(([0-9.]+)([KMGT])i?B?\)")
_EXCEEDED = re.compile(r"Used [0-9.]+[KMGT] of ([0-9.]+)([KMGT]) hbm\. Exceeded hbm capacity by ([0-9.]+)([KMGT])")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def out_of_memory(message: str, abstract_state, chip: ChipSpec) -> Memory:
    """Memory of a program the compiler refused for HBM, from its message: 'Ran out of memory on HBM,
    the total memory required for HLO temporaries (27.11G) exceeds available HBM (15.75G)' gives a
    requirement of 27.11 GiB (the first size the message names); 'Used 15.75G of 15.75G hbm. Exceeded
    hbm capacity by 5.29M.' gives the capacity plus the excess."""
    exceeded = _EXCEEDED.search(message)
    if exceeded:
        cap, cap_unit, over, over_unit = exceeded.groups()
        sizes = [float(cap) * _UNITS[cap_unit] + float(over) * _UNITS[over_unit]]
    else:
        sizes = [float(v) * _UNITS[u] for v, u in _SIZE.findall(message)]
    return Memory(
        params=shard_bytes(abstract_state["params"]),
        optimizer=shard_bytes(abstract_state["opt_state"]),
        arguments=0,
        outputs=0,
        aliased=0,
        temporaries=0,
        code=0,
        hbm=chip.hbm_bytes,
        compiler_error=message.strip().splitlines()[0][:500],
        required=int(sizes[0]) if sizes else None,
    )


def cost(compiled) -> dict:
    """The compiler's per-device FLOPs and HBM bytes accessed for one step."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    return {"flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0))}


def roofline(
    *,
    hlo_cost: dict,
    collective_summary: dict,
    model_flops_per_chip: float,
    chip: ChipSpec,
    recompute_flops_per_chip: float = 0.0,
    state_bytes_per_chip: float = 0.0,
) -> dict:
    """Step-time terms (seconds), the bound, and the MFU it implies; with the chip numbers used.
    `recompute_flops_per_chip`: the rematerialised forward, computed but not model FLOPs;
    `state_bytes_per_chip`: parameters and optimizer state, read and written by every update."""

    def traffic(net: str) -> float:
        return float(sum(v["traffic_bytes"] for v in collective_summary.get(net, {}).values()))

    terms = {
        # Floors under the compiler's counts (module docstring): a compute-bound step with
        # remat_policy=full has an MFU of at most ~75%.
        "compute_s": max(hlo_cost["flops"], model_flops_per_chip + recompute_flops_per_chip) / chip.peak_flops,
        "hbm_s": max(hlo_cost["bytes_accessed"], 2.0 * state_bytes_per_chip) / chip.hbm_bandwidth,
        "ici_s": traffic("ici") / chip.ici_bandwidth,
        "dcn_s": traffic("dcn") / chip.dcn_bandwidth,
    }
    step_s = max(terms.values())
    return {
        **{k: round(v, 6) for k, v in terms.items()},
        "step_time_s": round(step_s, 6),
        "bound_by": max(terms, key=terms.get).removesuffix("_s"),
        "model_flops_per_chip": model_flops_per_chip,
        "recompute_flops_per_chip": recompute_flops_per_chip,
        "hlo_flops_per_chip": hlo_cost["flops"],
        "mfu": round(model_flops_per_chip / (step_s * chip.peak_flops), 4) if step_s > 0 else None,
        "chip": dataclasses.asdict(chip),
    }
