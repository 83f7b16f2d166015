"""The model families and presets reference: every registered family (`jlong.config.registry.FAMILIES`), the
model fields each one reads, and every preset of configs/models with its numbers and its file's header comment.

Which fields a family reads is what its Hugging Face form carries: the fields its `hf_fields` reads back from
the config.json its `hf_config` writes for each of its presets (the way `jlong convert` and `model.hf_path`
go), the fields its presets set, and those its `config_defaults` imply.
"""

from __future__ import annotations

import json
from pathlib import Path

from jlong.config import schema
from jlong.config.loading import load_preset, preset_names, presets_dir
from jlong.docgen.markdown import GENERATED, anchored, code, paragraph, table


def _families():
    import jlong.components  # noqa: F401  (every built-in family registers itself)
    from jlong.config.registry import FAMILIES

    return {name: FAMILIES.named(name) for name in FAMILIES.names()}


def preset_family(raw: dict) -> str | None:
    """The family a preset's fields name (Hugging Face's `model_type`, or jlong's `family`)."""
    return raw.get("family") or raw.get("model_type")


def presets_by_family() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in preset_names():
        found.setdefault(preset_family(load_preset(name)), []).append(name)
    return found


def _model_of(raw: dict) -> schema.ModelConfig:
    return schema.ModelConfig(**{key: value for key, value in raw.items() if key != "preset"})


def fields_by_family() -> dict[str, list[str]]:
    """The model fields each family reads, in the schema's order (see the module's docstring)."""
    presets = presets_by_family()
    order = list(schema.ModelConfig.model_fields)
    read = {}
    for name, family in _families().items():
        fields = set(family.config_defaults())
        for preset in presets.get(name, []):
            raw = load_preset(preset)
            fields |= {key for key in raw if key in order}
            model = _model_of(raw)
            fields |= set(family.hf_fields(family.hf_config(model), f"{preset}'s config.json"))
        read[name] = [field for field in order if field in fields]
    return read


def header_comment(path: Path) -> str:
    """The comment lines a preset file opens with, joined."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def _value(value) -> str:
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, (list, tuple)):
        return code("[" + ", ".join(map(str, value)) + "]")
    if isinstance(value, dict):
        return code(json.dumps(value))
    return code(value)


def _links(fields) -> str:
    return ", ".join(f"[{code(field)}](config.md#model.{field})" for field in fields)


def _families_table(families, presets) -> str:
    rows = []
    for name, family in families.items():
        defaults = ", ".join(f"{key}: {_value(value)}" for key, value in family.config_defaults().items())
        listed = ", ".join(f"[{preset}](#preset-{preset})" for preset in presets.get(name, []))
        rows.append([anchored(name, f"family-{name}"), code(family.hf_architecture),
                     ", ".join(map(code, family.known_layer_types)), defaults or "none", listed or "none"])
    return table(["`model.family`", "Hugging Face architecture", "layer types", "defaults it implies", "presets"],
                 rows)


def _fields_table(families, read) -> str:
    """Model fields (rows) by family (columns): a mark where the family reads the field, its default where it
    implies one."""
    every = set.intersection(*map(set, read.values()))
    rows = []
    for field in schema.ModelConfig.model_fields:
        if field in every or not any(field in fields for fields in read.values()):
            continue
        marks = []
        for name, family in families.items():
            defaults = family.config_defaults()
            marks.append(f"= {_value(defaults[field])}" if field in defaults else "✓" if field in read[name] else "")
        rows.append([f"[{code(field)}](config.md#model.{field})", *marks])
    return table(["field", *map(code, families)], rows)


def _presets_table() -> str:
    rows = []
    for name in preset_names():
        raw = load_preset(name)
        model = _model_of(raw)
        experts = (f"{model.num_experts} ({model.num_experts_per_tok} per token)" if model.num_experts else "")
        heads = f"{model.num_attention_heads} / {model.kv_heads}"
        rows.append([anchored(name, f"preset-{name}"),
                     f"[{code(model.family)}](#family-{model.family})", model.num_hidden_layers, model.hidden_size,
                     heads, experts, header_comment(presets_dir() / f"{name}.yaml")])
    return table(["`model.preset`", "family", "layers", "hidden size", "heads (q / kv)", "experts", "description"],
                 rows)


def families_page() -> str:
    families = _families()
    presets = presets_by_family()
    read = fields_by_family()
    every = [field for field in schema.ModelConfig.model_fields if all(field in r for r in read.values())]
    own = [field for field in schema.ModelConfig.model_fields if not any(field in r for r in read.values())]
    return "\n".join([
        "# Model families and presets\n",
        GENERATED.format(source="the family registry (`jlong.families`) and configs/models"),
        "`model.family` names the architecture, as Hugging Face's `model_type` does; a preset (`model.preset`) "
        "or a Hugging Face checkpoint (`model.hf_path`) names it for you. A script adds a family with "
        "`jlong.families.register`.\n",
        "## Families { #families }\n",
        _families_table(families, presets),
        "## Model fields by family { #model-fields-by-family }\n",
        paragraph(__doc__.split("\n\n")[1]) + "\n",
        f"Every family reads {_links(every)}, and jlong's own {_links(own)} name where the fields come from. "
        "The other fields, by family (✓: read; = value: read, with the default the family implies):\n",
        _fields_table(families, read),
        "## Presets { #presets }\n",
        "The files of `configs/models/`, each named by `model.preset=<name>`; a config's own `model` fields lie "
        "over the preset's. Heads are query / key-value heads.\n",
        _presets_table(),
    ])
