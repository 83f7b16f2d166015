"""jlong `model` fields -> a Hugging Face config.json, as the model's family
writes it (every built-in family registered: `jlong.components`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jlong.components  # noqa: F401
from jlong.config.registry import FAMILIES

if TYPE_CHECKING:
    from jlong.config.schema import ModelConfig


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config`, as its family writes it."""
    return FAMILIES.named(config.family).hf_config(config)
