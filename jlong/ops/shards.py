"""What the model's maths needs to know of the devices it runs on.

The model names the logical axes of its arrays (`batch`, `seq`, `embed`, ...)
and never a mesh axis. Where it cares how an array is split (pinning a
layout, running code on each device's shard, exchanging heads, passing keys
around a ring), it asks a `Shards` value that its caller hands it
explicitly: `OneDevice` here, or `jlong.parallel.placement.MeshShards` for a
device mesh. Nothing is read from an ambient context.
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

    @property
    def ulysses_size(self) -> int:
        """C: the sp degree, over which attention exchanges heads all-to-all."""

    @property
    def ulysses_axis(self) -> str | None:
        """The sp mesh axis when it has more than one device (else None)."""

    @property
    def ring_size(self) -> int:
        """R: how many sp groups pass keys and values around in ring attention."""

    @property
    def ring_axis(self) -> str | None:
        """The ring mesh axis when it has more than one group (else None)."""

    @property
    def all_axes(self) -> tuple[str, ...]:
        """Every mesh axis: a sum over the whole batch runs over all of them."""

    def constrain(self, x, axes: Axes):
        """x pinned to its compute placement."""

    def map(self, fn: Callable, in_axes: tuple[Axes, ...], out_axes: Axes) -> Callable:
        """`fn` on each device's shard: arguments and result split by their
        logical axes (`REPLICATED` for whole ones)."""


@dataclasses.dataclass(frozen=True)
class OneDevice:
    """Unsharded: every array whole, per-device code run on the whole array."""

    ulysses_size: int = 1
    ulysses_axis: str | None = None
    ring_size: int = 1
    ring_axis: str | None = None
    all_axes: tuple[str, ...] = ()

    def constrain(self, x, axes: Axes):
        return x

    def map(self, fn, in_axes, out_axes):
        return fn
