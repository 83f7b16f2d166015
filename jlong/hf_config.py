"""Hugging Face config.json <-> jlong `model` fields, without jax: the
file's `model_type` names the family (`jlong.families`), which reads and
writes its own fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jlong.errors import JlongError
from jlong.families import family_named, family_of, names

if TYPE_CHECKING:
    from jlong.config import ModelConfig


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The jlong `model` fields that a Hugging Face config.json describes."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise JlongError(f"Hugging Face checkpoint {str(path)!r} has no config.json")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise JlongError(f"cannot parse {config_path}: {err.msg} at line {err.lineno}") from None
    model_type = hf.get("model_type")
    if model_type not in names():
        raise JlongError(f"{config_path}: model_type {model_type!r} is not supported (supported: {', '.join(names())})")
    return family_named(model_type).hf_fields(hf, str(config_path))


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """config.json for `config`, as its family writes it."""
    return family_of(config).hf_config(config)
