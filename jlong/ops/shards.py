"""What the model's maths needs to know of the devices it runs on.

The model names the logical axes of its arrays (`batch`, `seq`, `embed`, ...)
and never a mesh axis. Where it cares how an array is split (pinning a
layout, running code on each device's shard, exchanging heads, passing keys
around a ring), it asks a `Shards` value that its caller hands it
explicitly: `OneDevice` here, or `jlong.parallel.placement.MeshShards` for a
device mesh. Nothing is read from an ambient context. Mesh axes are named as
the config's `mesh` section names them (`sp`, `ring`, ...); code that runs
collectives over one asks its size and its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

Axes = tuple[str, ...]
REPLICATED: Axes = ()  # as a `Shards.map` spec: the same value on every device

TOKENS: Axes = ("batch", "seq")
HIDDEN: Axes = ("batch", "seq", "embed")


class Shards(Protocol):
    """How arrays with logical axes are split over devices while computing."""

    def size(self, axis: str) -> int:
        """How many devices the mesh axis `axis` has (1 without it)."""

    def axis(self, axis: str) -> str | None:
        """The mesh axis `axis` to run collectives over, when it has more than one device (else None)."""

    @property
    def all_axes(self) -> tuple[str, ...]:
        """The mesh axes a sum over the whole batch runs over."""

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Every axis of the mesh, of one device or more."""

    def constrain(self, x, axes: Axes):
        """x pinned to its compute placement."""

    def map(self, fn: Callable, in_axes: tuple[Axes, ...], out_axes: Axes | tuple[Axes, ...]) -> Callable:
        """`fn` on each device's shard: arguments and result split by their
        logical axes (`REPLICATED` for whole ones); a tuple of results by a
        tuple of axes."""


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """Unsharded: every array whole, per-device code run on the whole array."""

    all_axes: tuple[str, ...] = ()
    mesh_axes: tuple[str, ...] = ()

    def size(self, axis: str) -> int:
        return 1

    def axis(self, axis: str) -> str | None:
        return None

    def constrain(self, x, axes: Axes):
        return x

    def map(self, fn, in_axes, out_axes):
        return fn
