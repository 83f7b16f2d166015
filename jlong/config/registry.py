"""The named parts a run's config chooses among, each registered here by the
layer that defines it: model families (`jlong.families`) and
sequence-parallel methods (`jlong.attention.methods`, which check the
attention kernels they run). The schema imports none of them (as Levanter's
`LmConfig.register_subclass` and torchtitan's model specs keep the job config
plain data): it reads a family's defaults, and calls its checks and the
method's, through what was registered.

`jlong.components` imports every built-in part, so that each registers
itself; the command line and the Python API import it before reading a
config.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from jlong.errors import JlongError

Part = TypeVar("Part")


class Registry(Generic[Part]):
    """Parts by name, for the config key `key` (a `kind` of part)."""

    def __init__(self, kind: str, key: str, how_to_add: str = ""):
        self.kind, self.key, self.how_to_add = kind, key, how_to_add
        self.parts: dict[str, Part] = {}

    def add(self, name: str, part: Part) -> Part:
        """Makes `part` known as `name` (replacing one of the same name, so a notebook can register it again)."""
        self.parts[name] = part
        return part

    def names(self) -> list[str]:
        return sorted(self.parts)

    def require(self) -> None:
        """Raises when nothing is registered: the layer that registers its parts was not imported."""
        if not self.parts:
            raise JlongError(f"no {self.kind} is registered yet: import jlong.components (the command line and "
                             "jlong's Python API do) before reading a config")

    def named(self, name: str, where: str | None = None) -> Part:
        self.require()
        if name not in self.parts:
            add = f"; {self.how_to_add}" if self.how_to_add else ""
            raise JlongError(f"{where or self.key} {name!r} is not a {self.kind} jlong knows (known: "
                             f"{', '.join(self.names())}{add})")
        return self.parts[name]


FAMILIES: Registry = Registry("model family", "model.family", "a new one is registered with jlong.families.register")
SP_METHODS: Registry = Registry("sequence-parallel method", "attention.sp_method")
