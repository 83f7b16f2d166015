"""Per-device memory of the configured train step, compiled ahead of time.

Nothing is allocated: the step is lowered with `jax.ShapeDtypeStruct`
parameters, optimizer state and batch, compiled for the configured mesh, and
XLA's memory analysis says what each device needs. Host-offloaded bytes do not
show in that analysis (on CPU the offload compiles to nothing), so they are
counted from the remat policy and the shapes.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jlong.config import Config
from jlong.model.remat import offloads_layer_inputs
from jlong.parallel.mesh import batch_sharding, make_mesh
from jlong.train.optimizer import make_optimizer
from jlong.train.state import Model
from jlong.train.step import make_train_step, opt_state_layout

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device. `temporaries` is XLA's peak scratch minus the
    gradients: the activations kept for the backward pass and the working
    buffers of the busiest moment. `saved_layer_inputs` is the part of it
    (or of `host_offload`) that the remat policy keeps per layer."""

    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    temporaries: int
    saved_layer_inputs: int
    host_offload: int
    budget: int

    @property
    def device_total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.inputs + self.temporaries

    @property
    def fits(self) -> bool:
        return self.device_total <= self.budget

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "device_total": self.device_total, "fits": self.fits}


def plan(config: Config, *, budget_gib: float = 80.0, devices=None) -> MemoryPlan:
    """Compiles the train step of `config` for its mesh and reports per-device bytes."""
    mesh = make_mesh(config.mesh, devices)
    model = Model(config, mesh)
    optimizer = make_optimizer(config.train)
    opt_shardings, abstract_opt_state = opt_state_layout(optimizer, model)
    abstract_params = model.abstract_params()
    batch = abstract_batch(config, mesh)
    step = make_train_step(model, optimizer, opt_shardings)
    analysis = step.lower(abstract_params, abstract_opt_state, batch).compile().memory_analysis()

    parameters = shard_bytes(abstract_params)
    gradients = parameters  # one gradient per parameter, placed like it
    layer_inputs = saved_layer_input_bytes(config)
    return MemoryPlan(
        parameters=parameters,
        gradients=gradients,
        optimizer_state=shard_bytes(abstract_opt_state),
        inputs=shard_bytes(batch),
        temporaries=max(analysis.temp_size_in_bytes - gradients, 0),
        saved_layer_inputs=layer_inputs,
        host_offload=layer_inputs if offloads_layer_inputs(config.memory.remat) else 0,
        budget=int(budget_gib * GIB),
    )


def abstract_batch(config: Config, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes `jlong.data.sources.Batches` gives, without reading data."""
    shape = (config.train.batch_size, config.train.seq_len)
    keys = ["inputs", "targets"]
    if config.data.eos_id is not None:
        keys += ["segment_ids", "positions"]
    sharding = batch_sharding(mesh)
    return {key: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for key in keys}


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def saved_layer_input_bytes(config: Config) -> int:
    """One [B, S/sp, D] layer input per layer in the compute dtype, on each device,
    for the policies that keep exactly the layer inputs."""
    if config.memory.remat not in ("save_inputs", "offload_inputs", "save_attention"):
        return 0
    mesh, train, model = config.mesh, config.train, config.model
    local_tokens = train.batch_size // (mesh.data * mesh.fsdp) * train.seq_len // mesh.sp
    itemsize = jnp.dtype(train.compute_dtype).itemsize
    return model.num_hidden_layers * local_tokens * model.hidden_size * itemsize
