"""A projection weight with a low-rank adapter beside it, applied in the layer: x W + scale (x A) B.

`LowRank(w, a, b, scale)` stands where a projection's weight W [*lead, *in, *out] sits in the
params the model runs with (`trainer.model.lora.attach`); A is [*lead, *in, r] and B [*lead, r, *out]
(`lead`: the stacked layers dim, if any). The layer multiplies its input by W and, separately, by A then
B (`layers.project`), so neither W + scale A B nor a gradient of W's size is ever formed: the adapters'
gradients come through the [tokens, r] product only.

A pytree whose leaves are w, a and b (a scan over stacked layers slices all three together); `scale` is
static. Indexing with `[...]` returns the
value itself, as an `nnx.Param` reads its array, so it can stand in a Param's place.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRank:
    w: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float = dataclasses.field(metadata={"static": True})

    def __getitem__(self, index):
        if index is not Ellipsis:
            raise TypeError(f"LowRank supports only [...] (the whole value), not [{index!r}]")
        return self
