"""Activation sharding by logical name: the model says *what* a dim is, this says *where* it lives.

`activation_sharding(mesh, rules)` is entered once per attempt (in the train step builder); inside it
`constrain(x, names)` pins an activation to the mesh axes the rules give for those logical names.
Outside any context (single device, tests of pure math) `constrain` is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding

from trainer.parallel.rules import logical_to_spec

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh, rules: Sequence):
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names (identity when no mesh is active)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    spec = logical_to_spec(names, x.shape, mesh, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
