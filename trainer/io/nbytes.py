"""The size of a tree of arrays: what a save, restore, snapshot or transfer of it moves."""

from __future__ import annotations

import math

import jax
import numpy as np


def tree_nbytes(tree) -> int:
    """Bytes of the arrays (device, host, or ShapeDtypeStructs) in `tree` at their global shapes: what a
    save, restore, snapshot or transfer moves."""
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
