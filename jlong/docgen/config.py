"""The configuration reference, from the schema (`jlong.config.schema`): every section and every field, with its
type, default, allowed values and the description the schema gives it; the entries of the lists whose items
are settings of their own (data.mix, eval.mix, stages); and, for the model's fields, the families that read
each one.

Types and bounds are read from the fields' validators (`jlong.config.types` and the schema's own). A validator
this module does not know stops the page with an error naming the field, so a new kind of field is described
here before the site builds again.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types as python_types
import typing
from typing import Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator
from pydantic_core import PydanticUndefined

from jlong.config import schema
from jlong.config import types as config_types
from jlong.options import REMAT_NAMES
from jlong.docgen.markdown import GENERATED, anchored, code, paragraph, table

# Lists in the schema whose items are checked against a model of their own (mappings in the schema's types).
ENTRY_MODELS: dict[str, type[BaseModel]] = {"data.mix": schema.MixSource, "eval.mix": schema.CorpusEntry}


@dataclasses.dataclass
class Kind:
    """What a field takes: its type in words and the values allowed (bounds or choices), if limited."""

    type: str
    allowed: str = ""


def _values(names) -> str:
    return ", ".join(code(name) for name in names)


# The field types of `jlong.config.types`, by their validators.
_BASE_KINDS = {
    config_types.as_integer: "integer",
    config_types.as_number: "number",
    config_types._flag: "true or false",
    config_types._text: "string",
    config_types._paths: "path, or list of paths",
    config_types._mapping: "mapping",
}
_BOUNDS = {config_types._positive: "> 0", config_types._non_negative: ">= 0"}
# The schema's own validators of one field each.
_SCHEMA_KINDS = {
    schema._heads_per_stage: Kind("integer, `all`, `auto`, or null", "integer >= 0 (0 = `all`), `all`, `auto`"),
    schema._share: Kind("number", "0 to 1"),
    schema._fraction: Kind("number", "> 0, at most 1"),
    schema._key_digits: Kind("integer", "1 to 9"),
    schema._targets: Kind("name, or list of names", "PEFT module names, or `all-linear`"),
}


def _remat_runs_kind() -> Kind:
    return Kind("mapping of policy to layers", f"policies: {_values(REMAT_NAMES)}; layers: integer >= 1")


def _validators(annotation) -> list:
    return [m.func for m in getattr(annotation, "__metadata__", ()) if isinstance(m, (BeforeValidator, AfterValidator))]


def _closure(func) -> dict[str, Any]:
    return inspect.getclosurevars(func).nonlocals


def _kind_of_steps(steps: list, where: str) -> Kind:
    """The kind that a chain of validators checks: `jlong.config.types`' (their combinators `optional`,
    `sequence_of` and `choice` read from their closures) or the schema's own."""
    if len(steps) == 1 and steps[0] in _SCHEMA_KINDS:
        return _SCHEMA_KINDS[steps[0]]
    if steps == [schema._remat_runs]:
        return _remat_runs_kind()
    kind, bounds = None, []
    for step in steps:
        if step in _BASE_KINDS:
            kind = _BASE_KINDS[step]
        elif step in _BOUNDS:
            bounds.append(_BOUNDS[step])
        elif step.__qualname__ == "choice.<locals>.check":
            kind, bounds = "string", [_values(_closure(step)["names"])]
        elif step.__qualname__ == "optional.<locals>.check" and len(steps) == 1:
            parts = _closure(step)
            inner = _kind_of_steps([*parts["before"], *parts["after"]], where)
            return Kind(f"{inner.type}, or null", inner.allowed)
        elif step.__qualname__ == "sequence_of.<locals>.check" and len(steps) == 1:
            inner = _kind_of_steps(_closure(step)["steps"], where)
            return Kind(f"list of {_plural(inner.type)}", f"each {inner.allowed}" if inner.allowed else "")
        else:
            raise ValueError(f"{where}: jlong.docgen.config does not know the validator {step.__qualname__}: "
                             "describe it there")
    if kind is None:
        raise ValueError(f"{where}: no validator says what the field's type is")
    return Kind(kind, ", ".join(bounds))


def _plural(kind: str) -> str:
    return {"true or false": "flags", "path, or list of paths": "paths", "name, or list of names": "names"}.get(
        kind, f"{kind}s")


def _plain_kind(annotation, where: str) -> Kind:
    """The kind of an annotation without validators: a section, a list of entries, a plain Python type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, python_types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        kind = _plain_kind(inner, where)
        return Kind(f"{kind.type}, or null", kind.allowed)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return Kind("section")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if inspect.isclass(item) and issubclass(item, BaseModel):
            return Kind("list of entries")
        return Kind(f"list of {_plain_kind(item, where).type}s")
    if origin is dict or annotation is dict:
        return Kind("mapping")
    if origin is Literal:
        return Kind("string", _values(args))
    names = {int: "integer", float: "number", str: "string", bool: "true or false"}
    if annotation in names:
        return Kind(names[annotation])
    raise ValueError(f"{where}: jlong.docgen.config cannot describe the type {annotation!r}")


def kind_of(annotation, where: str) -> Kind:
    """The type in words and the allowed values of a field's annotation (`where` names it in errors)."""
    validators = _validators(annotation)
    return _kind_of_steps(validators, where) if validators else _plain_kind(annotation, where)


def default_of(field) -> str:
    """A field's default as YAML would write it; `required` when it has none."""
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "(its defaults)"
    value = field.default
    if value is None or value is PydanticUndefined:
        return "unset"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, (tuple, list)):
        return code("[" + ", ".join(str(v) for v in value) + "]")
    if isinstance(value, dict):
        return code(json.dumps(value))
    return code(value)


def registry_choices() -> dict[str, str]:
    """The allowed values of the fields whose names are registered (families, methods, kernels) or files."""
    import jlong.components  # noqa: F401  (every built-in part registers itself)
    from jlong.attention.kernels import impl_names
    from jlong.config.registry import FAMILIES, SP_METHODS
    from jlong.linear_attention import gated_delta
    from jlong.moe import grouped_matmul

    return {
        "model.family": _values(FAMILIES.names()) + ", or one a script registers",
        "model.preset": "a preset of [the presets](families.md#presets)",
        "attention.impl": _values(impl_names()),
        "attention.sp_method": _values(SP_METHODS.names()),
        "kernels.gated_delta": _values(["auto", *gated_delta.KERNELS]),
        "kernels.grouped_matmul": _values(["auto", *grouped_matmul.KERNELS]),
    }


def _section_of(annotation) -> type[BaseModel] | None:
    """The model of a section field (`LoraConfig | None` included)."""
    union = typing.get_origin(annotation) in (typing.Union, python_types.UnionType)
    for candidate in typing.get_args(annotation) if union else (annotation,):
        if inspect.isclass(candidate) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _entry_of(annotation) -> type[BaseModel] | None:
    """The model of each item of a list of entries (`tuple[Stage, ...]`)."""
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        if inspect.isclass(item) and issubclass(item, BaseModel):
            return item
    return None


def _anchor(path: str) -> str:
    return path.replace("[]", "")


def _rows(model: type[BaseModel], prefix: str, choices: dict[str, str], families: dict[str, str] | None):
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        kind = kind_of(field.rebuild_annotation(), path)
        row = [anchored(path, _anchor(path)), kind.type, default_of(field), choices.get(path, kind.allowed),
               field.description or ""]
        if families is not None:
            row.insert(4, families.get(name, "every family"))
        rows.append(row)
    return rows


def _model_table(model: type[BaseModel], prefix: str, choices: dict[str, str],
                 families: dict[str, str] | None = None) -> str:
    headers = ["key", "type", "default", "allowed", "description"]
    if families is not None:
        headers.insert(4, "families")
    return table(headers, _rows(model, prefix, choices, families))


def _model_families() -> dict[str, str]:
    """Each model field that only some families read: those families, linked to their table."""
    from jlong.docgen.families import fields_by_family

    read = fields_by_family()
    every = set.intersection(*map(set, read.values()))
    names = {}
    for field in schema.ModelConfig.model_fields:
        if field in every:
            continue
        readers = [family for family, fields in read.items() if field in fields]
        names[field] = ", ".join(readers) if readers else "every family"
    return names


def config_page() -> str:
    choices = registry_choices()
    config = schema.Config
    out = [
        "# Configuration\n",
        GENERATED.format(source="`jlong.config.schema`"),
        f"{paragraph(config.__doc__)} Values parse as YAML (`5e6` is accepted for integers); the loader checks "
        "each key and names a wrong one in one line. The model's fields come from a preset (`model.preset`), a "
        "Hugging Face checkpoint (`model.hf_path`) or the YAML itself, inline fields over the others.\n",
        "| section | what it sets |\n|---|---|",
    ]
    out += [f"| [{code(name)}](#{name}) | {paragraph(field.description)} |"
            for name, field in config.model_fields.items()]
    out.append("")
    for name, field in config.model_fields.items():
        out.append(f"## {name} {{ #{name} }}\n")
        section = _section_of(field.annotation)
        entry = _entry_of(field.annotation)
        if section is not None:
            out.append(f"{paragraph(section.__doc__)}\n")
            if section is schema.ModelConfig:
                out.append("A required field is set inline, or by `model.preset` or `model.hf_path` (and "
                           "`model.family` by the flags, as its description says). The families column names "
                           "the families whose Hugging Face config.json carries the field, or that imply a default "
                           "for it ([model fields by family](families.md#model-fields-by-family)); the others take "
                           "no part in it.\n")
            out.append(_model_table(section, f"{name}.", choices,
                                    _model_families() if section is schema.ModelConfig else None))
            for key, entry_model in ENTRY_MODELS.items():
                if key.startswith(f"{name}."):
                    out.append(f"### {key}[] entries {{ #{_anchor(key)}-entries }}\n")
                    out.append(f"{paragraph(entry_model.__doc__)}\n")
                    out.append(_model_table(entry_model, f"{key}[].", choices))
        elif entry is not None:
            out.append(table(["key", "type", "default", "allowed", "description"],
                             [[code(name), kind_of(field.rebuild_annotation(), name).type, default_of(field), "",
                               paragraph(field.description)]]))
            out.append(f"Each entry: {paragraph(entry.__doc__)}\n")
            out.append(_model_table(entry, f"{name}[].", choices))
        else:
            kind = kind_of(field.rebuild_annotation(), name)
            out.append(table(["key", "type", "default", "allowed", "description"],
                             [[code(name), kind.type, default_of(field), kind.allowed,
                               paragraph(field.description)]]))
    return "\n".join(out)
