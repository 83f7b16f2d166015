"""Reading a run configuration: YAML files, `section.key=value` overrides,
model presets and Hugging Face config.json files, into the schema.

Every problem is a `JlongError` with one line that names the key and the
fix: pydantic's errors are translated here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from jlong.config.schema import SECTIONS, Config, ModelConfig
from jlong.config.types import did_you_mean
from jlong.errors import JlongError
from jlong.config.huggingface import read_hf_config

# The fields that give the weights their shapes and roles: a checkpoint's
# config.json decides them. The others (RoPE, norm epsilon, positions) may be
# set inline over a checkpoint, to train it at a longer context, say.
WEIGHT_DEFINING_FIELDS = (
    "family", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm",
)


def read_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None) -> Config:
    """Reads a YAML config (or starts from `base`, a config's dict), applies
    `a.b=value` overrides, validates (its stages' own configs are
    `jlong.config.stages`'s to check: `load_config`)."""
    raw = _read_yaml(Path(path)) if path is not None else copy.deepcopy(base or {})
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    raw = dict(raw)
    for name in SECTIONS:
        # An empty section in YAML takes its defaults; `lora: null` (a dumped config without LoRA) stays off.
        if raw.get(name, {}) is None and name != "lora":
            raw[name] = {}
    if isinstance(raw.get("model"), dict):
        raw["model"] = _resolve_model_fields(raw["model"])
    return validated(Config, raw)


def config_to_dict(config: Config) -> dict[str, Any]:
    raw = config.model_dump(mode="json")  # lists, not tuples: what YAML writes and reads back
    if raw.get("lora") is None:  # no LoRA: no section (older readers took an empty one for LoRA's defaults)
        raw.pop("lora", None)
    return raw


def model_config(values: dict[str, Any]) -> ModelConfig:
    """A `model` section on its own (from a checkpoint's metadata or config.json)."""
    return validated(ModelConfig, values, prefix="model.")


def with_values(config: Config, **values: Any) -> Config:
    """`config` with some fields changed (`with_values(c, train={"seq_len": n})`), validated again."""
    raw = config.model_dump()
    for section, changes in values.items():
        raw[section] = {**raw[section], **changes}
    return validated(Config, raw)


def validated(schema: type[BaseModel], raw: dict[str, Any], prefix: str = "") -> BaseModel:
    """`schema` of `raw`, or a JlongError with the first problem in one line."""
    if not isinstance(raw, dict):
        raise JlongError(f"{prefix.rstrip('.') or 'the config'} must be a mapping of keys, got {raw!r}")
    try:
        return schema.model_validate(raw)
    except ValidationError as err:
        raise JlongError(_one_line(schema, err.errors()[0], prefix)) from None


def _one_line(schema: type[BaseModel], error: dict, prefix: str) -> str:
    """pydantic's error -> jlong's line: the dotted key, then the problem."""
    loc = [str(part) for part in error["loc"]]
    key = prefix + ".".join(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        if len(loc) == 1 and not prefix:
            return f"unknown config section {loc[0]!r}{did_you_mean(loc[0], [*SECTIONS, 'run_dir'])}"
        known = [f"{prefix}{'.'.join(loc[:-1])}.{name}".lstrip(".") for name in _fields_at(schema, loc[:-1])]
        return f"unknown config key {key}{did_you_mean(key, known)}"
    if kind == "missing":
        if key == "model":
            return "the config has no 'model' section: set model.preset or model.hf_path"
        return f"{key} is required: set it, or set model.preset / model.hf_path"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"config section {key!r} must be a mapping of keys, got {error['input']!r}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{key} {message}"


def _fields_at(schema: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        schema = schema.model_fields[part].annotation
    return list(schema.model_fields)


# --------------------------------------------------------------------------
# Presets and checkpoints


def presets_dir() -> Path:
    """configs/models of the source tree (or of the installed package)."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "configs" / "models", here / "configs" / "models"):
        if candidate.is_dir():
            return candidate
    raise JlongError("cannot find the model presets directory configs/models")


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        names = preset_names()
        raise JlongError(f"unknown model.preset {name!r}{did_you_mean(name, names)}; available: {', '.join(names)}")
    return _read_yaml(path)


def _resolve_model_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields: preset or HF config.json first, inline keys on top."""
    base: dict[str, Any] = {}
    if values.get("preset") is not None:
        if not isinstance(values["preset"], str):
            raise JlongError(f"model.preset must be a name, got {values['preset']!r}")
        base.update(load_preset(values["preset"]))
    if values.get("hf_path") is not None:
        checkpoint = read_hf_config(values["hf_path"])
        _check_matches_checkpoint(values, checkpoint)
        base.update(checkpoint)
    return {**base, **values}


def _check_matches_checkpoint(inline: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    for key in WEIGHT_DEFINING_FIELDS:
        if key not in inline or key not in checkpoint:
            continue
        field = ModelConfig.model_fields[key]
        try:
            value = TypeAdapter(field.rebuild_annotation()).validate_python(inline[key])
        except ValidationError as err:
            raise JlongError(f"model.{key} {err.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        if value != checkpoint[key]:
            raise JlongError(
                f"model.{key}={inline[key]!r} contradicts the checkpoint model.hf_path={inline['hf_path']!r}, "
                f"whose config.json has {key}={checkpoint[key]!r}; drop model.{key} (the checkpoint decides "
                "the shapes of its weights)"
            )


# --------------------------------------------------------------------------
# YAML and overrides


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise JlongError(f"config file {str(path)!r} is a directory; give the YAML file in it "
                         f"(a run directory's is {str(path / 'config.yaml')!r})")
    if not path.is_file():
        raise JlongError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "malformed YAML"
        raise JlongError(f"cannot parse {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JlongError(f"{path} must hold a YAML mapping of sections, not {type(data).__name__}")
    return data


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise JlongError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise JlongError(f"override {override!r}: {part!r} is not a section")
        node = child
    node[leaf] = value
