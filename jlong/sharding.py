"""Logical axis names -> mesh axes: the one place that decides placement.

Model code names the logical axes of its arrays (`batch`, `seq`, `embed`,
`heads`, ...) and calls `constrain`; nothing in the model knows a mesh. While
`use_rules(mesh, rules)` is active, `constrain` pins the array to the mesh
axes the rules give; outside it, `constrain` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("jlong_sharding_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh, rules: dict[str, str | tuple[str, ...] | None]):
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def partition_spec(axes: tuple[str | None, ...], rules) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def constrain(x, axes: tuple[str | None, ...]):
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, partition_spec(axes, rules)))


@dataclasses.dataclass(frozen=True)
class SequenceShards:
    """How the active rules split [batch, seq, ...] activations over the mesh,
    for code that runs per device (`shard_map`) on its own sequence shard."""

    mesh: jax.sharding.Mesh | None
    sp_axis: str | None
    batch_axes: str | tuple[str, ...] | None

    @property
    def size(self) -> int:
        """C: how many shards the sequence is cut into."""
        return 1 if self.sp_axis is None else self.mesh.shape[self.sp_axis]

    @property
    def collective_axis(self) -> str | None:
        """The sp axis when there is more than one shard along it (else None)."""
        return self.sp_axis if self.size > 1 else None

    @property
    def all_axes(self) -> tuple[str, ...]:
        """Every mesh axis: a sum over the whole batch runs over all of them."""
        return () if self.mesh is None else tuple(self.mesh.axis_names)

    def map(self, fn, in_kinds: tuple[str, ...], out_kind: str):
        """`fn` on each device's shard. Kinds: "tokens" ([B, S]), "hidden"
        ([B, S, D]), "replicated". Without a mesh, `fn` itself."""
        if self.mesh is None:
            return fn
        specs = {
            "tokens": PartitionSpec(self.batch_axes, self.sp_axis),
            "hidden": PartitionSpec(self.batch_axes, self.sp_axis, None),
            "replicated": PartitionSpec(),
        }
        return jax.shard_map(
            fn, mesh=self.mesh, in_specs=tuple(specs[k] for k in in_kinds), out_specs=specs[out_kind]
        )


def sequence_shards() -> SequenceShards:
    active = _ACTIVE.get()
    if active is None:
        return SequenceShards(None, None, None)
    mesh, rules = active
    return SequenceShards(mesh, rules.get("seq"), rules.get("batch"))
