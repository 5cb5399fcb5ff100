"""Activation sharding by logical name: the model says *what* a dim is, this says *where* it lives.

An `ActivationSharding(mesh, rules)` is built once per attempt (by the train step's compiler) and passed
explicitly down the model: `shard(x, names)` pins an activation to the mesh axes the rules give for those
logical names. `UNSHARDED` (no mesh: single device, tests of pure math, decoding) is the identity.

It is a static pytree (no leaves), so it can ride inside pytrees that go through jax.checkpoint, scan or
jit (the model's per-forward `Context`) and is compared by value there: the mesh, the rules, the
manual axes and the context-parallel strategy.

Inside the train step's per-replica region (`jax.shard_map` over the data axis, see
trainer/program/step.py) the data axis is manual: `within(("data",))` gives the sharding to use there,
whose specs leave the manual axes out and name the context's abstract mesh.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.parallel.rules import logical_to_spec


def _frozen_rules(rules: Sequence) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """logical_axis_rules (lists from the config) as a hashable tuple of (name, mesh axes) pairs.

    Same meaning for logical_to_spec: None is no axes and a bare string is one axis."""
    out = []
    for name, axes in rules:
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        out.append((name, tuple(axes)))
    return tuple(out)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """with_sharding_constraint by logical names on `mesh` under `rules`; the identity when mesh is None."""

    mesh: Mesh | None = None
    rules: tuple = ()
    manual: tuple[str, ...] = ()  # mesh axes that are manual where this sharding is used
    # How attention crosses the context axis (trainer/model/context_attention.py): all_gather | ring.
    context_strategy: str = "all_gather"

    def __post_init__(self):
        object.__setattr__(self, "rules", _frozen_rules(self.rules))

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        if self.mesh is None:
            return x
        return self.pin(x, self.spec(names, x.shape))

    def spec(
        self, names: Sequence[str | None], shape: Sequence[int], *, skip: Sequence[str] = ()
    ) -> PartitionSpec:
        """The spec for a value of `shape` (as seen here: per replica inside a manual region), using no
        mesh axis of `skip` (those another dim of the value already takes)."""
        return logical_to_spec(names, shape, self.mesh, self.rules, skip=(*self.manual, *skip))

    def pin(self, x: jax.Array, spec: PartitionSpec) -> jax.Array:
        """with_sharding_constraint to `spec` (a spec over the whole mesh; manual axes are left out)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.context_mesh(), self.local(spec)))

    def local(self, spec: PartitionSpec) -> PartitionSpec:
        """`spec` without the manual axes: how a value is split inside the manual region."""
        if not self.manual:
            return spec
        kept = [tuple(a for a in axes_of(e) if a not in self.manual) for e in spec]
        return PartitionSpec(*(None if not e else e[0] if len(e) == 1 else e for e in kept))

    def context_mesh(self):
        """The mesh to name in shardings and nested shard_maps: the abstract one inside a manual region."""
        return jax.sharding.get_abstract_mesh() if self.manual else self.mesh

    def within(self, manual: Sequence[str]) -> ActivationSharding:
        """This sharding as used inside a shard_map over the `manual` mesh axes."""
        return dataclasses.replace(self, manual=tuple(manual))

    def shards(self, names: Sequence[str | None], size: int) -> int:
        """How many ways a dim of `size` (as seen here) named `names[0]` is split (1 without a mesh)."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in axes_of(self.spec(names[:1], (size,))[0]))


def axes_of(entry) -> tuple[str, ...]:
    """A PartitionSpec entry (None, an axis or a tuple of axes) as a tuple of axes."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


UNSHARDED = ActivationSharding()
