"""Typed configuration: schema, layered loader, value typing and validation."""

from trainer.config.errors import ConfigError
from trainer.config.loader import build, explain, load_config, load_resolved, to_flat_dict, to_yaml
from trainer.config.schema import (
    CheckpointConfig,
    DataConfig,
    DecodeConfig,
    ElasticConfig,
    MeshConfig,
    ModelConfig,
    ObserveConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError",
    "build",
    "explain",
    "load_config",
    "load_resolved",
    "to_flat_dict",
    "to_yaml",
    "CheckpointConfig",
    "DataConfig",
    "DecodeConfig",
    "ElasticConfig",
    "MeshConfig",
    "ModelConfig",
    "ObserveConfig",
    "OptimConfig",
    "RunConfig",
    "TrainConfig",
]
