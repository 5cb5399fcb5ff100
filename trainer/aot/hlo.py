"""Collectives of a compiled step, read from its optimized HLO text: kind, count per step, bytes, ICI or DCN.

What the text shows, and so what this counts:
- In-slice collectives are HLO ops (`all-gather`, `reduce-scatter`, `all-reduce`, `all-to-all`,
  `collective-permute`, and their async `-start` forms). They run on the ICI.
- Across slices, a multi-slice TPU program exchanges data through the megascale runtime: `send` ops with
  `is_host_transfer=true` and `_xla_host_transfer_handler_name="xla_megascale_runtime"`, whose
  rendezvous names the collective they implement (`all-reduce.64_0`). They run on the DCN.
- Ops in a while loop (the layer scan, micro-steps) run once per iteration. The trip count is the
  constant the loop condition compares against, an upper bound when the compiler peeled an iteration.

Bytes are the full buffer of the collective on one chip (an all-gather's output, a reduce-scatter's
input), and `traffic_bytes` what one chip sends for it over a ring: (n-1)/n of the buffer, twice that
for an all-reduce.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import numpy as np

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in KINDS} | {"ragged-all-to-all": "all-to-all"}
_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALLEES = re.compile(
    r"\b(?:calls|to_apply|body|condition|called_computations|branch_computations)=\{?([^}\s,]+(?:,\s*%?[\w.\-]+)*)"
)
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{")
_MEGASCALE = '_xla_host_transfer_handler_name="xla_megascale_runtime"'
_RENDEZVOUS = re.compile(r'_xla_host_transfer_rendezvous="([a-z\-]+)')


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    network: str  # "ici" | "dcn"
    buffer_bytes: int  # per chip, one execution
    group_size: int  # chips taking part (slices, for DCN)
    executions: int  # per step (loop trip counts multiplied)
    shape: str = ""  # the arrays it moves, without layouts: "f32[2048,151936]"

    @property
    def traffic_bytes(self) -> float:
        """Bytes one chip sends for one execution (ring algorithm)."""
        n = max(self.group_size, 1)
        if self.kind == "collective-permute":
            return float(self.buffer_bytes)
        share = (n - 1) / n
        return self.buffer_bytes * share * (2 if self.kind == "all-reduce" else 1)


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[2], u32[]) send(...)' -> ('(f32[2], u32[])', 'send(...)')."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    shape, _, tail = rest.partition(" ")
    return shape, tail


def array_bytes(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape string (a tuple gives several)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _DTYPE_BYTES:
            out.append(int(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]))
    return out


def _shapes(shape: str) -> str:
    """'(f32[2,3]{1,0:T(8,128)}, u32[])' -> 'f32[2,3], u32[]'."""
    return ", ".join(f"{dtype}[{dims}]" for dtype, dims in _ARRAY.findall(shape) if dtype in _DTYPE_BYTES)


def largest(found: list[Collective], n: int = 8) -> list[dict]:
    """The `n` collectives that move the most bytes per step: what to look at first."""
    ranked = sorted(found, key=lambda c: c.buffer_bytes * c.executions, reverse=True)[:n]
    return [
        {
            "network": c.network,
            "kind": c.kind,
            "shape": c.shape,
            "group_size": c.group_size,
            "executions": c.executions,
            "bytes": c.buffer_bytes * c.executions,
        }
        for c in ranked
    ]


def replica_groups(line: str) -> list[list[int]] | None:
    """The device groups of a collective, from any of the forms XLA prints: explicit (`{{0,2},{1,3}}`),
    iota (`[2,2]<=[2,2]T(1,0)`), or named mesh axes (`mesh['data'=2,'fsdp'=2] {'data'}`, newer XLA on
    CPU: devices numbered row-major over the mesh, a group varies the named axes). None when absent."""
    m = _GROUPS_LIST.search(line)
    if m:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    m = _GROUPS_IOTA.search(line)
    if m:
        n_groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(d) for d in m.group(4).split(",")])
        return ids.reshape(n_groups, size).tolist()
    m = _GROUPS_MESH.search(line)
    if m:
        axes = [(name.strip("' "), int(n)) for name, n in (a.split("=") for a in m.group(1).split(","))]
        chosen = {a.strip("' ") for a in m.group(2).split(",") if a.strip()}
        ids = np.arange(math.prod(n for _, n in axes)).reshape([n for _, n in axes])
        order = [i for i, (a, _) in enumerate(axes) if a not in chosen] + [
            i for i, (a, _) in enumerate(axes) if a in chosen
        ]
        size = math.prod(n for a, n in axes if a in chosen)
        return ids.transpose(order).reshape(-1, size).tolist()
    return None


def _group_size(line: str, default: int) -> int:
    groups = replica_groups(line)
    if groups:
        return max(len(g) for g in groups)
    return 2 if _PAIRS.search(line) else default


def _parse(text: str):
    """Computations -> (instructions, callees); which one is the entry."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m:
                current = m.group(1)
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
        elif line.rstrip() == "}":  # not "}}, metadata=...": a Pallas kernel's config spans lines
            current = None
        else:
            comps[current].append(line)
    return comps, entry


def _trip_count(condition: list[str]) -> int:
    consts = [int(c) for line in condition for c in re.findall(r"[su](?:32|64)\[\][^=]*constant\((\d+)\)", line)]
    return max(consts) if consts else 1


def collectives(text: str, *, devices_per_slice: int, num_slices: int) -> list[Collective]:
    """Every collective of the module in `text`, with how often one step executes it."""
    comps, entry = _parse(text)
    found: list[Collective] = []

    def visit(name: str, times: int) -> None:
        if name not in comps:
            return
        for line in comps[name]:
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            shape, call = _split_shape(m.group(2))
            opcode = call.partition("(")[0]
            if opcode in _OPCODES:
                kind, sizes = _OPCODES[opcode], array_bytes(shape)
                if opcode.endswith("-start") and kind != "all-reduce":
                    sizes = [max(sizes, default=0)]  # (operand, result, ...): the larger one
                group = _group_size(line, devices_per_slice)
                size = sum(sizes) * (group if kind == "reduce-scatter" else 1)
                found.append(Collective(kind, "ici", size, group, times, _shapes(shape)))
            elif opcode == "send" and _MEGASCALE in line:
                r = _RENDEZVOUS.search(line)
                kind = r.group(1) if r and r.group(1) in KINDS else "all-reduce"
                moved = _shapes(shape).split(", ")[0]  # (data, u32[] context, token[])
                found.append(Collective(kind, "dcn", (array_bytes(shape) or [0])[0], num_slices, times, moved))
            if opcode == "while":
                body = re.search(r"body=%?([\w.\-]+)", line)
                cond = re.search(r"condition=%?([\w.\-]+)", line)
                n = _trip_count(comps.get(cond.group(1), [])) if cond else 1
                if body:
                    visit(body.group(1), times * n)
                continue
            for callees in _CALLEES.findall(line):
                for callee in callees.split(","):
                    visit(callee.strip().lstrip("%"), times)

    if entry is not None:
        visit(entry, 1)
    return found


def summarize(found: list[Collective]) -> dict:
    """{network: {kind: {"count", "bytes", "traffic_bytes"}}} per step and chip, zero kinds left out."""
    out: dict = defaultdict(lambda: defaultdict(lambda: {"count": 0, "bytes": 0, "traffic_bytes": 0.0}))
    for c in found:
        row = out[c.network][c.kind]
        row["count"] += c.executions
        row["bytes"] += c.buffer_bytes * c.executions
        row["traffic_bytes"] += c.traffic_bytes * c.executions
    return {
        net: {k: dict(v, traffic_bytes=int(v["traffic_bytes"])) for k, v in kinds.items()}
        for net, kinds in out.items()
    }
