"""The shared decoder's params <-> Hugging Face safetensors names and layouts: the tensor plan.

Pure mapping, no file I/O (`trainer/hf/` streams the files). The decoder's param layout is the one
every family here publishes (Qwen3, Qwen3-MoE and Llama name their tensors alike), so one rule covers
them; the layout itself is in the `transformer.py` docstring:

    HF name = "model." + our path with "/" -> "." + ".weight", layer i = layers.{i} (or index i of the
    stacked L dim), experts stacked over e as mlp.experts.{e}.*, mlp/router = mlp.gate, lm_head outside
    "model.". A matrix W [out, in] is stored transposed, with its in/out dims split into heads.

`tensor_plan(cfg)` lists, for every param leaf, the HF tensors (`Piece`s) that fill it; both directions
of the conversion walk it, one tensor at a time, so neither needs a second copy of the model. A family
whose params are laid out otherwise brings its own plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from trainer.config.schema import ModelConfig
from trainer.model.transformer import abstract_params

_TOP_LEVEL = {
    "embed_tokens": ("model.embed_tokens.weight", 0),
    "norm": ("model.norm.weight", 0),
    "lm_head": ("lm_head.weight", 1),
}
_EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Piece:
    """One HF tensor and where it goes in a param leaf.

    `index` selects the slot in the leaf (stacked layer, expert); the rest of the leaf is the piece.
    `in_dims` = 0: stored as is (norms, embedding). n > 0: a linear layer, HF W [out, in] with
    ours = W.T reshaped, whose first n dims are the input (2 for o_proj [N, hd, D], else 1)."""

    hf_name: str
    index: tuple[int, ...]
    in_dims: int

    def hf_shape(self, piece_shape: tuple[int, ...]) -> tuple[int, ...]:
        if not self.in_dims:
            return piece_shape
        return (math.prod(piece_shape[self.in_dims :]), math.prod(piece_shape[: self.in_dims]))

    def to_ours(self, w: np.ndarray, piece_shape: tuple[int, ...]) -> np.ndarray:
        return w.reshape(piece_shape) if not self.in_dims else w.T.reshape(piece_shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if not self.in_dims:
            return x
        return x.reshape(math.prod(x.shape[: self.in_dims]), -1).T


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A param leaf (path into the params dict) and the HF tensors that make it up."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        return self.shape[len(piece.index) :]


def tensor_plan(cfg: ModelConfig) -> list[Leaf]:
    """Every param leaf of `cfg` (in the params' key order) with the HF tensors that fill it."""
    return [
        Leaf(path, tuple(shape), tuple(_pieces(cfg, path))) for path, shape in _leaf_shapes(abstract_params(cfg))
    ]


def _leaf_shapes(tree, prefix: tuple[str, ...] = ()):
    for k in sorted(tree):
        if isinstance(tree[k], dict):
            yield from _leaf_shapes(tree[k], prefix + (k,))
        else:
            yield prefix + (k,), tree[k].shape


def _pieces(cfg: ModelConfig, path: tuple[str, ...]) -> list[Piece]:
    if path[0] != "layers":
        name, in_dims = _TOP_LEVEL[path[0]]
        return [Piece(name, (), in_dims)]
    if cfg.scan_layers:
        layers, rest, stacked = range(cfg.base_num_decoder_layers), path[1:], True
    else:
        layers, rest, stacked = [int(path[1])], path[2:], False
    sub = ".".join(rest)
    if sub == "mlp.router":
        sub = "mlp.gate"
    in_dims = 0 if rest[-1].endswith("norm") else (2 if sub == "self_attn.o_proj" else 1)
    out = []
    for layer in layers:
        lead = (layer,) if stacked else ()
        if cfg.num_experts > 1 and rest[0] == "mlp" and rest[1] in _EXPERT_MATRICES:
            out += [
                Piece(f"model.layers.{layer}.mlp.experts.{e}.{rest[1]}.weight", lead + (e,), in_dims)
                for e in range(cfg.num_experts)
            ]
        else:
            out.append(Piece(f"model.layers.{layer}.{sub}.weight", lead, in_dims))
    return out


def set_leaf(params: dict, path: tuple[str, ...], value) -> None:
    for k in path[:-1]:
        params = params.setdefault(k, {})
    params[path[-1]] = value


def get_leaf(params: Mapping, path: tuple[str, ...]):
    for k in path:
        params = params[k]
    return params
