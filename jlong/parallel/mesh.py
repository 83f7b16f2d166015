"""The device mesh and the one table that places every array on it.

Mesh axes: `data` x `fsdp` x `sp`. Parameters, gradients and optimizer state
are sharded over all three (ZeRO-3 over the whole group, as ALST and UPipe
do: sequence-parallel ranks hold different parameter shards too). Batches are
split over `data` and `fsdp` on the batch axis and over `sp` on the sequence.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jlong.config import MeshConfig
from jlong.errors import JlongError

MESH_AXES = ("data", "fsdp", "sp")
BATCH_AXES = ("data", "fsdp")

# Logical axis -> mesh axes for activations (and for weights at compute time,
# where they are whole: FSDP gathers each layer's weights before it runs).
ACTIVATION_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": BATCH_AXES,
    "seq": "sp",
}

# A parameter is sharded over every device along the first of these logical
# axes whose size the device count divides; tensors with none stay replicated.
PARAM_SHARDED_AXES = ("embed", "mlp", "vocab", "heads", "kv_heads")


def make_mesh(config: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The data x fsdp x sp mesh over `devices` (default: all of them)."""
    devices = jax.devices() if devices is None else list(devices)
    if config.size != len(devices):
        raise JlongError(
            f"mesh.data x mesh.fsdp x mesh.sp = {config.data} x {config.fsdp} x {config.sp} = "
            f"{config.size}, but {len(devices)} devices are visible; make the product {len(devices)}"
        )
    return jax.make_mesh(
        (config.data, config.fsdp, config.sp), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices
    )


def param_spec(shape: tuple[int, ...], axes: tuple[str, ...], mesh) -> PartitionSpec:
    devices = mesh.size
    for logical in PARAM_SHARDED_AXES:
        if logical in axes and shape[axes.index(logical)] % devices == 0:
            spec = [None] * len(shape)
            spec[axes.index(logical)] = MESH_AXES
            return PartitionSpec(*spec)
    return PartitionSpec()


def batch_sharding(mesh) -> NamedSharding:
    """[batch, seq] arrays: batch over data x fsdp, sequence over sp."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, "sp"))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())
