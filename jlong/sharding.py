"""Logical axis names -> mesh axes: the one place that decides placement.

Model code names the logical axes of its arrays (`batch`, `seq`, `embed`,
`heads`, ...) and calls `constrain`; nothing in the model knows a mesh. While
`use_rules(mesh, rules)` is active, `constrain` pins the array to the mesh
axes the rules give; outside it, `constrain` does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars

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


def active_rules():
    """(mesh, rules) while `use_rules` is active, else None."""
    return _ACTIVE.get()


def partition_spec(axes: tuple[str | None, ...], rules) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) if a is not None else None for a in axes))


def constrain(x, axes: tuple[str | None, ...]):
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, partition_spec(axes, rules)))
