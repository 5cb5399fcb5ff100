"""TPU slice shapes (xpk's --tpu-type names): chips, hosts and the GKE node labels of each. Multi-host slices
have 4 chips per host."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TpuSlice:
    tpu_type: str  # xpk --tpu-type, e.g. v5litepod-16
    pathways_version: str  # Pathways resource manager instance type prefix, e.g. tpuv5e
    gke_accelerator: str  # node label cloud.google.com/gke-tpu-accelerator
    topology: str  # node label cloud.google.com/gke-tpu-topology
    machine_type: str  # GKE machine type of a host: PathwaysJob workers[].type (an enum of its CRD)
    chips_per_host: int = 4

    @property
    def chips(self) -> int:
        n = 1
        for d in self.topology.split("x"):
            n *= int(d)
        return n

    @property
    def hosts(self) -> int:
        return max(1, self.chips // self.chips_per_host)

    @property
    def instance_type(self) -> str:
        return f"{self.pathways_version}:{self.topology}"


def _tpu_table() -> dict[str, TpuSlice]:
    table: dict[str, TpuSlice] = {}
    two_d = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
    for chips, topo in two_d.items():
        if chips == 8:  # 8-chip v5e/v6e slices are single 8-chip hosts (different machine type); not listed
            continue
        name = f"v5litepod-{chips}"
        table[name] = TpuSlice(name, "tpuv5e", "tpu-v5-lite-podslice", topo, "ct5lp-hightpu-4t")
        table[f"v6e-{chips}"] = TpuSlice(f"v6e-{chips}", "tpuv6e", "tpu-v6e-slice", topo, "ct6e-standard-4t")
    # v5p / v4 names count TensorCores (2 per chip).
    three_d = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
    for chips, topo in three_d.items():
        table[f"v5p-{2 * chips}"] = TpuSlice(f"v5p-{2 * chips}", "tpuv5", "tpu-v5p-slice", topo, "ct5p-hightpu-4t")
        table[f"v4-{2 * chips}"] = TpuSlice(f"v4-{2 * chips}", "tpuv4", "tpu-v4-podslice", topo, "ct4p-hightpu-4t")
    return table


TPU_TYPES = _tpu_table()
