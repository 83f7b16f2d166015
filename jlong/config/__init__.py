"""The run configuration: its schema (`schema`, on pydantic, with the field
types of `types`), the rules between sections (`validation`), and reading
it from YAML, overrides, presets and checkpoints (`loading`)."""

from jlong.config.loading import (
    config_from_dict,
    config_to_dict,
    load_config,
    model_config,
    preset_names,
    presets_dir,
    with_values,
)
from jlong.config.schema import (
    SECTIONS,
    AttentionConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    MemoryConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
)

__all__ = [
    "SECTIONS", "AttentionConfig", "CheckpointConfig", "Config", "DataConfig", "MemoryConfig", "MeshConfig",
    "ModelConfig", "TrainConfig", "config_from_dict", "config_to_dict", "load_config", "model_config",
    "preset_names", "presets_dir", "with_values",
]
