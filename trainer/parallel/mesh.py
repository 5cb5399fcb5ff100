"""Devices grouped into slices, and the mesh over the active slices.

Mesh axes are ("data", "fsdp", "context", "tensor", "expert"). Slices are data-parallel replicas: the data axis
is (active slices) x ici_data_parallelism, slice-major, so dropping a slice shrinks only the data axis.
Under Pathways a device's slice is its `slice_index`; on CPU/GPU `num_slices` groups the local devices
into equal virtual slices so that slice failures can be emulated and tested.
The context axis (sequence sharding, trainer/parallel/context.py) lives inside a slice only, so the
slices stay data-parallel replicas whatever it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.sharding import Mesh

from trainer.config.errors import ConfigError
from trainer.config.schema import MeshConfig

MESH_AXES = ("data", "fsdp", "context", "tensor", "expert")


@dataclass(frozen=True)
class IciShape:
    """The mesh shape inside one slice."""

    data: int
    fsdp: int
    tensor: int
    expert: int
    context: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.context * self.tensor * self.expert


def group_into_slices(devices: Sequence, num_slices: int) -> list[list]:
    """Devices -> slices: by `slice_index` when devices have one (TPU/Pathways), else equal contiguous groups."""
    devices = list(devices)
    if devices and all(getattr(d, "slice_index", None) is not None for d in devices) and num_slices > 1:
        by_slice: dict[int, list] = {}
        for d in devices:
            by_slice.setdefault(d.slice_index, []).append(d)
        if len(by_slice) != num_slices:
            raise ConfigError(
                f"num_slices={num_slices} but the devices belong to {len(by_slice)} slices; "
                f"set num_slices={len(by_slice)}"
            )
        return [by_slice[k] for k in sorted(by_slice)]
    if len(devices) % num_slices:
        raise ConfigError(
            f"num_slices={num_slices} does not divide the {len(devices)} devices; "
            f"choose a divisor of {len(devices)}"
        )
    per = len(devices) // num_slices
    return [devices[i * per : (i + 1) * per] for i in range(num_slices)]


def resolve_ici(cfg: MeshConfig, devices_per_slice: int) -> IciShape:
    """Fill the one -1 axis so the ici axes multiply to the devices of a slice, or explain the mismatch."""
    dims = {
        "data": cfg.ici_data_parallelism,
        "fsdp": cfg.ici_fsdp_parallelism,
        "tensor": cfg.ici_tensor_parallelism,
        "expert": cfg.ici_expert_parallelism,
        "context": cfg.ici_context_parallelism,
    }
    fixed = math.prod(v for v in dims.values() if v != -1)
    fill = [k for k, v in dims.items() if v == -1]
    if fill:
        if devices_per_slice % fixed:
            raise ConfigError(
                f"ici parallelism {dims} cannot fill {devices_per_slice} devices per slice: "
                f"the fixed axes multiply to {fixed}, which does not divide {devices_per_slice}"
            )
        dims[fill[0]] = devices_per_slice // fixed
    shape = IciShape(**dims)
    if shape.size != devices_per_slice:
        raise ConfigError(
            f"ici parallelism data={shape.data} fsdp={shape.fsdp} context={shape.context} "
            f"tensor={shape.tensor} expert={shape.expert} multiplies to {shape.size}, but each slice has "
            f"{devices_per_slice} devices; make them multiply to {devices_per_slice} "
            f"(or set one to -1)"
        )
    return shape


def build_mesh(cfg: MeshConfig, slices: Sequence[Sequence]) -> Mesh:
    """The mesh over the given (active) slices; every slice must have the same device count."""
    sizes = {len(s) for s in slices}
    if len(sizes) != 1:
        raise ConfigError(f"slices have unequal device counts {sorted(sizes)}")
    ici = resolve_ici(cfg, sizes.pop())
    inner = (ici.fsdp, ici.context, ici.tensor, ici.expert)
    per_slice = [np.array(s, dtype=object).reshape(ici.data, *inner) for s in slices]
    grid = np.stack(per_slice).reshape(len(slices) * ici.data, *inner)
    return Mesh(grid, MESH_AXES)


def batch_shards(mesh: Mesh) -> int:
    """How many ways the batch dim is split (the data, fsdp and expert axes)."""
    return mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
