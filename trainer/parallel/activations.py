"""Activation sharding by logical name: the model says *what* a dim is, this says *where* it lives.

An `ActivationSharding(mesh, rules)` is built once per attempt (by the train step's compiler) and passed
explicitly down the model: `shard(x, names)` pins an activation to the mesh axes the rules give for those
logical names. `UNSHARDED` (no mesh: single device, tests of pure math, decoding) is the identity.

It is a static pytree (no leaves), so it can ride inside pytrees that go through jax.checkpoint, scan or
jit (the model's per-forward `Context`) and is compared by value there: the mesh and the rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

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

    def __post_init__(self):
        object.__setattr__(self, "rules", _frozen_rules(self.rules))

    def __call__(self, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
        if self.mesh is None:
            return x
        spec = logical_to_spec(names, x.shape, self.mesh, self.rules)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


UNSHARDED = ActivationSharding()
