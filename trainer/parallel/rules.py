"""Logical axis names -> mesh PartitionSpecs, from the config's `logical_axis_rules`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def _rule_table(rules: Sequence) -> dict[str, tuple[str, ...]]:
    table = {}
    for name, axes in rules:
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        table[name] = tuple(axes)
    return table


def logical_to_spec(
    names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Sequence, *, skip: Sequence[str] = ()
) -> PartitionSpec:
    """Map each dim's logical name to mesh axes.

    A dim takes its rule's mesh axes in order while their product still divides the dim size, skipping
    axes of size 1 and axes an earlier dim already uses; so a 2-way kv_heads dim on a 4-way tensor axis
    is replicated instead of failing, and `batch` over (data, fsdp) uses whichever axes exist. Axes in
    `skip` (manual ones, inside a shard_map over them) are never picked.
    """
    table = _rule_table(rules)
    used: set[str] = set()
    out = []
    for name, size in zip(names, shape):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no entry in logical_axis_rules; add [{name!r}, [...]]")
        picked, product = [], 1
        for axis in table[name]:
            if axis not in mesh.shape or axis in used or axis in skip or mesh.shape[axis] == 1:
                continue
            if size % (product * mesh.shape[axis]):
                continue
            picked.append(axis)
            product *= mesh.shape[axis]
        used.update(picked)
        out.append(None if not picked else (picked[0] if len(picked) == 1 else tuple(picked)))
    return PartitionSpec(*out)


def tree_shardings(logical_tree: Any, abstract_tree: Any, mesh: Mesh, rules: Sequence) -> Any:
    """NamedShardings for a pytree, given the same-structured trees of logical names and shapes."""
    return jax.tree.map(
        lambda names, a: NamedSharding(mesh, logical_to_spec(names, a.shape, mesh, rules)),
        logical_tree,
        abstract_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )
