"""TPU compile targets: a topology name -> compile-only devices, and each chip's published numbers.

`compile_topology` takes the accelerator-type names Cloud TPU and MaxText use (`v5e-16`, `v6e-8`,
`v5p-32`) or a chip layout (`v5e:4x4`, `v5p:2x2x4`). Devices come from libtpu's topology
description (`jax.experimental.topologies`): real TPU devices that can be compiled for and never run,
so the compile needs no TPU and allocates nothing.
"""

from __future__ import annotations

import dataclasses
import math
import re

from trainer.config.errors import ConfigError

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class ChipSpec:
    """Per-chip numbers for the fit and the roofline estimate (bytes and bytes/s; FLOP/s dense bf16)."""

    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    ici_bandwidth: float  # bidirectional, all ports of one chip
    dcn_bandwidth: float  # one chip's share of its host's data-center network
    source: str


# Cloud TPU system-architecture pages (cloud.google.com/tpu/docs/v5e, /v5p, /v6e), per chip. HBM "GB"
# there are GiB (the runtime reports 16 GiB on a v5e). DCN per chip: v5e's page gives 6.4 Tbps per
# 256-chip pod (2 x 100 Gbps NICs per 8-chip host), 25 Gbps = 3.125 GB/s per chip; v5p and v6e pages
# publish no per-chip DCN figure, so the same share is assumed there.
_DCN_PER_CHIP = 6.4e12 / 8 / 256
CHIPS = {
    "v5e": ChipSpec("TPU v5e", 16 * GIB, 197e12, 819e9, 400e9, _DCN_PER_CHIP, "cloud.google.com/tpu/docs/v5e"),
    "v5p": ChipSpec(
        "TPU v5p",
        95 * GIB,
        459e12,
        2765e9,
        4800e9 / 8,
        _DCN_PER_CHIP,
        "cloud.google.com/tpu/docs/v5p (DCN assumed)",
    ),
    "v6e": ChipSpec(
        "TPU v6e", 32 * GIB, 918e12, 1638e9, 800e9, _DCN_PER_CHIP, "cloud.google.com/tpu/docs/v6e (DCN assumed)"
    ),
}

# Chips -> layout. v5e/v6e slices are 2D; v5p slices are 3D and named by TensorCores (2 per chip).
_LAYOUT_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_LAYOUT_3D = {
    4: "2x2x1",
    8: "2x2x2",
    16: "2x2x4",
    32: "2x4x4",
    64: "4x4x4",
    128: "4x4x8",
    256: "4x8x8",
    512: "8x8x8",
}


@dataclasses.dataclass(frozen=True)
class Target:
    """One slice's chip layout, how many slices, and the chip."""

    generation: str  # v5e | v5p | v6e
    layout: str  # e.g. "4x4" or "2x2x4"
    num_slices: int

    @property
    def chip(self) -> ChipSpec:
        return CHIPS[self.generation]

    @property
    def chips_per_slice(self) -> int:
        return math.prod(int(x) for x in self.layout.split("x"))

    @property
    def name(self) -> str:
        cores = self.chips_per_slice * (2 if self.generation == "v5p" else 1)
        one = f"{self.generation}-{cores}"
        return one if self.num_slices == 1 else f"{self.num_slices}x {one}"


def parse_topology(name: str, num_slices: int) -> Target:
    """`v5e-16` / `v5e:4x4` (and v5p, v6e) -> Target; a ConfigError naming the accepted forms otherwise."""
    if num_slices < 1:
        raise ConfigError(f"compile_topology_num_slices={num_slices}: must be >= 1")
    known = ", ".join(sorted(CHIPS))
    m = re.fullmatch(r"(v\d+[a-z]*)[-:](.+)", name.strip().lower())
    gen = m.group(1) if m else ""
    if gen not in CHIPS:
        raise ConfigError(
            f"compile_topology={name!r}: unknown TPU; give <chip>-<size> or <chip>:<layout> with chip one of "
            f"{known} (e.g. compile_topology=v5e-16 or v5e:4x4)"
        )
    rest, table = m.group(2), (_LAYOUT_3D if gen == "v5p" else _LAYOUT_2D)
    if ":" in name:
        dims = rest.split("x")
        if len(dims) != (3 if gen == "v5p" else 2) or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ConfigError(
                f"compile_topology={name!r}: a {gen} layout has {3 if gen == 'v5p' else 2} dimensions, "
                f"e.g. {gen}:{next(iter(table.values()))}"
            )
        return Target(gen, rest, num_slices)
    if not rest.isdigit():
        raise ConfigError(f"compile_topology={name!r}: the size after '-' must be a number (e.g. {gen}-16)")
    chips = int(rest) // (2 if gen == "v5p" else 1)
    if chips not in table:
        sizes = ", ".join(f"{gen}-{c * (2 if gen == 'v5p' else 1)}" for c in table)
        raise ConfigError(f"compile_topology={name!r}: not a {gen} slice size; one of {sizes}")
    return Target(gen, table[chips], num_slices)


def topology_devices(target: Target) -> list:
    """The target's compile-only TPU devices, all slices (loads libtpu; no TPU needed)."""
    try:
        from jax.experimental import topologies

        kwargs = {}
        if target.chips_per_slice < 4:  # libtpu's default host is 2x2 chips: smaller slices need a smaller one
            kwargs["chips_per_host_bounds"] = tuple(int(x) for x in target.layout.split("x")) + (1,) * (
                3 - len(target.layout.split("x"))
            )
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=f"{target.generation}:{target.layout}",
            num_slices=target.num_slices,
            **kwargs,
        )
    except RuntimeError as e:
        if "TPU support not installed" in str(e):
            raise ConfigError(
                'compiling for TPU needs libtpu: pip install -e ".[tpu]" (no TPU needed on this machine)'
            ) from e
        raise ConfigError(f"compile_topology={target.name}: libtpu rejected it: {e}") from e
    return list(desc.devices)
