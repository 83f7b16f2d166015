"""Field types of the configuration, as YAML and the command line give them.

pydantic's lax coercion would read `steps: 2.5` as 2 and `shuffle: 1` as
true; these types take only what a person means: integers (also written
5e6 or 5_000_000), numbers, true/false, text, mappings. Each failure is a
short phrase ("must be an integer, got 'many'") that the loader prefixes
with the key (`jlong.config.loading`).
"""

from __future__ import annotations

import difflib
import math
import typing
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator


def _as_number(value: Any) -> float | int | None:
    """Numbers, and numeric strings such as '5e6' that YAML 1.1 leaves as text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def as_integer(value: Any) -> int:
    number = _as_number(value)
    if number is None or not float(number).is_integer():
        raise ValueError(f"must be an integer, got {value!r}")
    return int(number)


def as_number(value: Any) -> float:
    number = _as_number(value)
    if number is None:
        raise ValueError(f"must be a number, got {value!r}")
    return float(number)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"must be a string, got {value!r}")
    return value


def _paths(value: Any) -> str | tuple[str, ...]:
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, str) for item in value):
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"must be a path or a list of paths, got {value!r}")
    return value


def _mapping(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping, got {value!r}")
    return value


def _positive(value):
    if value <= 0:
        raise ValueError(f"must be positive, got {value}")
    return value


def _non_negative(value):
    if value < 0:
        raise ValueError(f"must not be negative, got {value}")
    return value


Integer = Annotated[int, BeforeValidator(as_integer)]
PositiveInt = Annotated[int, BeforeValidator(as_integer), AfterValidator(_positive)]
NonNegativeInt = Annotated[int, BeforeValidator(as_integer), AfterValidator(_non_negative)]
Number = Annotated[float, BeforeValidator(as_number)]
PositiveNumber = Annotated[float, BeforeValidator(as_number), AfterValidator(_positive)]
NonNegativeNumber = Annotated[float, BeforeValidator(as_number), AfterValidator(_non_negative)]
Flag = Annotated[bool, BeforeValidator(_flag)]
Text = Annotated[str, BeforeValidator(_text)]
Paths = Annotated[str | tuple[str, ...], BeforeValidator(_paths)]  # a token file or shard directory, or a list
Mapping = Annotated[dict, BeforeValidator(_mapping)]


def did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def choice(options: type) -> type:
    """One of a `Literal`'s values, with a suggestion when a value is close to one."""
    names = typing.get_args(options)

    def check(value: Any):
        if value not in names:
            raise ValueError(f"must be one of {', '.join(names)}; got {value!r}{did_you_mean(str(value), list(names))}")
        return value

    return Annotated[options, BeforeValidator(check)]


def optional(kind):
    """`kind` (one of the types above), or null."""
    before = [m.func for m in kind.__metadata__ if isinstance(m, BeforeValidator)]
    after = [m.func for m in kind.__metadata__ if isinstance(m, AfterValidator)]

    def check(value):
        if value is None:
            return None
        for step in (*before, *after):
            value = step(value)
        return value

    return Annotated[kind.__origin__ | None, BeforeValidator(check)]


def sequence_of(kind):
    """A YAML list of `kind` (one of the types above), kept as a tuple; a single value is a list of one."""
    steps = [m.func for m in kind.__metadata__ if isinstance(m, (BeforeValidator, AfterValidator))]

    def check(value):
        values = value if isinstance(value, (list, tuple)) else [value]
        checked = []
        for item in values:
            for step in steps:
                item = step(item)
            checked.append(item)
        return tuple(checked)

    return Annotated[tuple[kind.__origin__, ...], BeforeValidator(check)]
