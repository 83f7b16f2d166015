"""The run configuration: its schema (`schema`, on pydantic, with the field
types of `types`), the rules between sections (`validation`, calling the
checks of the family and the sequence-parallel method a config names, which
register themselves in `registry`), and reading it from YAML, overrides,
presets, Hugging Face config.json files (`huggingface`) and checkpoints
(`loading`; `stages.load_config` checks each stage's config too).

Nothing here imports a family, a method, a kernel or linear attention: they
import the config."""

from jlong.config.loading import (
    config_from_dict,
    config_to_dict,
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
from jlong.config.stages import load_config

__all__ = [
    "SECTIONS", "AttentionConfig", "CheckpointConfig", "Config", "DataConfig", "MemoryConfig", "MeshConfig",
    "ModelConfig", "TrainConfig", "config_from_dict", "config_to_dict", "load_config", "model_config",
    "preset_names", "presets_dir", "with_values",
]
