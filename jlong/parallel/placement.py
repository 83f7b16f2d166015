"""Where every array lives on the data x fsdp x ring x sp mesh, decided by one table.

Model code names the logical axes of its arrays (`batch`, `seq`, `embed`,
`heads`, ...) and never a mesh axis. `LOGICAL_AXES` maps each logical axis to
mesh axes twice:

- at compute: activations split their batch over data x fsdp and their
  sequence over ring x sp (sp the minor axis: consecutive devices, one node,
  hold consecutive shards and exchange heads all-to-all; ring attention runs
  across the sp groups); weight axes are whole (`GATHERED_AT_COMPUTE`: FSDP gathers
  each layer's weights just before the layer runs);
- at rest: parameters, gradients and optimizer state are split over every
  device (ZeRO-3 over the whole group, as ALST and UPipe do: the sp ranks
  hold different parameter shards too) along the first of their weight axes,
  in the table's order, whose size the device count divides; a tensor with
  none stays replicated.

`MeshShards(mesh)` is what the model is handed to run on a mesh: it pins
arrays to their compute placement and runs per-device code on each device's
shard (`shard_map` with specs from the same table). The model itself never
sees a mesh axis, and with `jlong.ops.shards.OneDevice` runs unsharded.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jlong.config import MeshConfig
from jlong.errors import JlongError
from jlong.ops.shards import TOKENS, Axes

MESH_AXES = ("data", "fsdp", "ring", "sp")
BATCH_AXES = ("data", "fsdp")
GATHERED_AT_COMPUTE = None  # a weight axis is whole on every device while its layer computes


@dataclasses.dataclass(frozen=True)
class AxisRule:
    at_compute: str | tuple[str, ...] | None
    rest_order: int | None = None  # parameters: preference for carrying the FSDP shard; None = never


LOGICAL_AXES: dict[str, AxisRule] = {
    "batch": AxisRule(at_compute=BATCH_AXES),
    "seq": AxisRule(at_compute=("ring", "sp")),
    "embed": AxisRule(GATHERED_AT_COMPUTE, rest_order=0),
    "mlp": AxisRule(GATHERED_AT_COMPUTE, rest_order=1),
    "vocab": AxisRule(GATHERED_AT_COMPUTE, rest_order=2),
    "heads": AxisRule(GATHERED_AT_COMPUTE, rest_order=3),
    "kv_heads": AxisRule(GATHERED_AT_COMPUTE, rest_order=4),
    "head_dim": AxisRule(GATHERED_AT_COMPUTE),
    "conv_channels": AxisRule(GATHERED_AT_COMPUTE, rest_order=5),  # linear attention's q, k, v channels
    "conv_taps": AxisRule(GATHERED_AT_COMPUTE),
    "experts": AxisRule(GATHERED_AT_COMPUTE, rest_order=6),  # a mixture's experts
    "latent": AxisRule(GATHERED_AT_COMPUTE, rest_order=7),  # latent attention's compressed query and key-value
    "layers": AxisRule(GATHERED_AT_COMPUTE),  # the scan over layers takes one at a time
    "documents": AxisRule(GATHERED_AT_COMPUTE),  # a row's documents (`jlong.model.document_sums`)
    "lora_rank": AxisRule(GATHERED_AT_COMPUTE),  # a LoRA adapter's rank (`jlong.lora`): a few dozen, never split
    # A sampler's caches (`jlong.generation`): the cached tokens split as the sequence was, and a linear-attention
    # layer's state by the heads each sp device ran (Ulysses' head layout).
    "cached_tokens": AxisRule(at_compute=("ring", "sp")),
    "sp_heads": AxisRule(at_compute="sp"),
    "head_stages": AxisRule(GATHERED_AT_COMPUTE),
    "window": AxisRule(GATHERED_AT_COMPUTE),  # a sliding window's cached tokens, whole on each device
}



def _rule(axis: str) -> AxisRule:
    try:
        return LOGICAL_AXES[axis]
    except KeyError:
        raise ValueError(f"unknown logical axis {axis!r}; the placement table has {', '.join(LOGICAL_AXES)}") from None


def _mesh_axes(axis: str) -> tuple[str, ...]:
    """The mesh axes logical axis `axis` is split over at compute."""
    at_compute = _rule(axis).at_compute
    return () if at_compute is None else (at_compute,) if isinstance(at_compute, str) else at_compute


def compute_spec(axes: Axes, whole: Axes = ()) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes while computing
    (the axes in `whole` unsplit)."""
    return PartitionSpec(*(None if axis in whole else _rule(axis).at_compute for axis in axes))


def rest_spec(shape: tuple[int, ...], axes: Axes, num_devices: int) -> PartitionSpec:
    """The PartitionSpec of a parameter (its gradient, its optimizer moments) at rest."""
    candidates = sorted((_rule(a).rest_order, i) for i, a in enumerate(axes) if _rule(a).rest_order is not None)
    for _, i in candidates:
        if shape[i] % num_devices == 0:
            return PartitionSpec(*(MESH_AXES if j == i else None for j in range(len(shape))))
    return PartitionSpec()


def make_mesh(config: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The data x fsdp x ring x sp mesh over `devices` (default: all of them)."""
    devices = jax.devices() if devices is None else list(devices)
    if config.size != len(devices):
        raise JlongError(
            f"mesh.data x mesh.fsdp x mesh.ring x mesh.sp = {config.data} x {config.fsdp} x {config.ring} x "
            f"{config.sp} = {config.size}, but {len(devices)} devices are visible; make the product {len(devices)}"
        )
    shape = (config.data, config.fsdp, config.ring, config.sp)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def compute_sharding(mesh, axes: Axes) -> NamedSharding:
    return NamedSharding(mesh, compute_spec(axes))


def batch_sharding(mesh) -> NamedSharding:
    """[batch, seq] token arrays: batch over data x fsdp, sequence over sp."""
    return compute_sharding(mesh, TOKENS)


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@dataclasses.dataclass(frozen=True)
class MeshShards:
    """A mesh as the model sees it (`jlong.ops.shards.Shards`): each device
    holds a shard of the batch and of the sequence, placed by the table;
    logical axes in `whole` stay unsplit (a sampler's decode step: one token
    per sequence, every device of a sequence holding it)."""

    mesh: jax.sharding.Mesh
    whole: Axes = ()

    def size(self, axis: str) -> int:
        return self.mesh.shape.get(axis, 1)

    def axis(self, axis: str) -> str | None:
        return axis if self.size(axis) > 1 else None

    @property
    def all_axes(self) -> tuple[str, ...]:
        """The mesh axes a sum over the whole batch runs over: all but those only the axes kept whole split."""
        kept_whole = {axis for name in self.whole for axis in _mesh_axes(name)}
        return tuple(axis for axis in self.mesh.axis_names if axis not in kept_whole)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    def constrain(self, x, axes: Axes):
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, compute_spec(axes, self.whole)))

    def map(self, fn, in_axes: tuple, out_axes):
        """`fn` per device; each argument's and result's logical axes, or a
        tuple or dict of them for a tuple or dict of arrays."""
        return jax.shard_map(fn, mesh=self.mesh, in_specs=tuple(self._specs(a) for a in in_axes),
                             out_specs=self._specs(out_axes))

    def _specs(self, axes):
        """PartitionSpecs for logical axes: one array's (a tuple of names), or a tuple or dict of such."""
        if isinstance(axes, dict):
            return {key: self._specs(a) for key, a in axes.items()}
        if all(isinstance(name, str) for name in axes):
            return compute_spec(axes, self.whole)
        return tuple(self._specs(a) for a in axes)
