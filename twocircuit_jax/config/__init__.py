"""Run configuration: typed sections, YAML files, `--set a.b=c` overrides, cross-circuit validation."""

from twocircuit_jax.config.base import ConfigError, from_dict, register, registered, to_dict
from twocircuit_jax.config.run import RunConfig, apply_overrides, load_config, parse_set, save_config
from twocircuit_jax.config.sections import (
    AnchorConfig,
    EvalConfig,
    FastConfig,
    GRPOConfig,
    MathFilesTask,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    ReasoningGymTask,
    SamplerConfig,
    SamplingConfig,
    SFTConfig,
    TaskConfig,
    TrainConfig,
)

__all__ = [
    "AnchorConfig",
    "ConfigError",
    "EvalConfig",
    "FastConfig",
    "GRPOConfig",
    "MathFilesTask",
    "MeshConfig",
    "ModelConfig",
    "OptimConfig",
    "ReasoningGymTask",
    "RunConfig",
    "SamplerConfig",
    "SamplingConfig",
    "SFTConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "from_dict",
    "load_config",
    "parse_set",
    "register",
    "registered",
    "save_config",
    "to_dict",
]
