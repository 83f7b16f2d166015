"""A Hugging Face config.json as jlong `model` fields: its `model_type` names
the family (one registered with the config, `jlong.config.registry`), which
reads its own fields."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jlong.config.registry import FAMILIES
from jlong.errors import JlongError

# Image-text checkpoints whose text model is a family jlong knows: model_type -> what it is.
IMAGE_TEXT = {"gemma3": "Gemma 3", "qwen3_5": "Qwen3.5", "qwen3_5_moe": "Qwen3.5-MoE"}
_noted: set[tuple[str, str]] = set()


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The jlong `model` fields that a Hugging Face config.json describes (of
    an image-text checkpoint, its text model's: `text_config`)."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise JlongError(f"Hugging Face checkpoint {str(path)!r} has no config.json")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise JlongError(f"cannot parse {config_path}: {err.msg} at line {err.lineno}") from None
    model_type = hf.get("model_type")
    if model_type in IMAGE_TEXT and isinstance(hf.get("text_config"), dict):
        _note(config_path, f"a {IMAGE_TEXT[model_type]} image-text checkpoint: reading its text model "
                           "(text_config and the language model's tensors); the vision tower is left out")
        hf = {"model_type": f"{model_type}_text", **hf["text_config"]}
        model_type = hf["model_type"]
    FAMILIES.require()
    if model_type not in FAMILIES.names():
        raise JlongError(f"{config_path}: model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(FAMILIES.names())})")
    family = FAMILIES.named(model_type)
    for part in family.hf_left_out(hf):
        _note(config_path, f"{part} is left out")
    return family.hf_fields(hf, str(config_path))


def _note(config_path: Path, what: str) -> None:
    """Says `what` on stderr, once per checkpoint and note."""
    if (str(config_path), what) not in _noted:
        _noted.add((str(config_path), what))
        print(f"jlong: {config_path}: {what}", file=sys.stderr)


def hf_stop_ids(path: str | Path) -> tuple[int, ...]:
    """The end-of-sequence ids generation stops at, as transformers' `generate` takes them: the checkpoint's
    generation_config.json `eos_token_id` (one id or a list), else its config.json's (an image-text
    checkpoint's text model's too); () where neither names one."""
    for name in ("generation_config.json", "config.json"):
        file = Path(path) / name
        if not file.is_file():
            continue
        try:
            found = json.loads(file.read_text())
        except json.JSONDecodeError as err:
            raise JlongError(f"cannot parse {file}: {err.msg} at line {err.lineno}") from None
        eos = found.get("eos_token_id", (found.get("text_config") or {}).get("eos_token_id"))
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()
