"""What a model family is to the trainer: its decoder, its FLOPs, its Hugging Face mapping, its presets.

A family is one package `trainer/model/<family>/` whose `FAMILY` is a `ModelFamily`; the registry
(`trainer/model/families.py`) keys them by the `model_family` config value the presets set. The runtime
never names a family: it calls `trainer.model`'s functions, which ask the config's family. What the
families here share (the decoder blocks of `layers.py`, `attention.py`, `moe.py`, the KV-cache decoding
of `generation.py`, the tensor layout of `hf_tensors.py`, the FLOPs of `flops.py`) stays shared; a family
fills in what differs: a decoder of its own where the blocks differ, and always its config.json
translation and its presets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax

from trainer.config.schema import ModelConfig
from trainer.parallel.activations import ActivationSharding

Params = dict[str, Any]


class Decoder(Protocol):
    """The functional facade of a decoder: plain param dicts in and out, the config static (the contract
    of each function is in `trainer/model/__init__.py`, which calls them)."""

    def init_params(self, cfg: ModelConfig, rng: jax.Array) -> Params: ...

    def abstract_params(self, cfg: ModelConfig) -> Params: ...

    def param_logical_axes(self, cfg: ModelConfig) -> Params: ...

    def forward(
        self,
        params: Params,
        cfg: ModelConfig,
        inputs: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        *,
        shard: ActivationSharding = ...,
        layers: Any = ...,
    ) -> tuple[jax.Array, jax.Array]: ...

    def logits_from_hidden(self, params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array: ...

    def logits_pullback(
        self, params: Params, cfg: ModelConfig, hidden: jax.Array, d_logits: jax.Array
    ) -> tuple[Params, jax.Array]: ...

    def output_rows(self, params: Params, cfg: ModelConfig, ids: jax.Array) -> jax.Array: ...


class Flops(Protocol):
    """Analytic size and work of a decoder (no allocation)."""

    def count_params(self, cfg: ModelConfig) -> tuple[int, int]: ...

    def training_flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float: ...

    def recompute_flops_per_token(self, cfg: ModelConfig, seq_len: int) -> float: ...


@dataclasses.dataclass(frozen=True)
class HfMapping:
    """A family's Hugging Face side.

    architectures: config.json `model_type` -> the `architectures` entry it is published with;
    model_keys(config.json, model_type, source) -> the ModelConfig keys it describes (HfFormatError
        naming the key and `source`, the file, for anything unsupported);
    config_json(cfg, dtype) -> the config.json transformers loads for `cfg` (HfFormatError when `cfg`
        has no equivalent in the family's architecture);
    tensor_plan(cfg) -> every param leaf with the safetensors tensors that fill it (`hf_tensors.Leaf`)."""

    architectures: Mapping[str, str]
    model_keys: Callable[[Mapping[str, Any], str, str], dict[str, Any]]
    config_json: Callable[[ModelConfig, str], dict[str, Any]]
    tensor_plan: Callable[[ModelConfig], list]


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One family: its `model_family` value, decoder, FLOPs, Hugging Face mapping and preset names
    (configs/models/<preset>.yml, each setting `model_family` to `name`)."""

    name: str
    decoder: Decoder
    flops: Flops
    hf: HfMapping
    presets: tuple[str, ...]
