"""Per-device memory of the configured train step, compiled ahead of time.

Nothing is allocated: the step is lowered with `jax.ShapeDtypeStruct`
parameters, optimizer state and batch, compiled for the configured mesh, and
XLA's memory analysis says what each device needs.

Compiled for CPU devices (a laptop planning a GPU mesh), three corrections
make the figures those of the program a GPU would run:
- XLA:CPU widens bfloat16 buffers to float32, so bfloat16 is planned as
  float16, which has the same size and which the CPU keeps as it is;
- it also runs 16-bit matmuls in float32; the pass that rewrites them is
  switched off for the plan's compile (`CPU_COMPILER_OPTIONS`);
- host offload compiles to nothing on CPU, so the offloaded layer inputs sit
  in the temporaries; they are counted from the remat policy and the shapes,
  reported as host bytes, and taken out of the device's temporaries.
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

# XLA:CPU computes 16-bit matmuls in float32 (converted operands, float32
# result); a GPU does not. Without this pass the CPU keeps them 16-bit.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "change-op-data-type"}


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
    """Compiles the train step of `config` for its mesh and reports per-device bytes.
    `devices` defaults to the first mesh-size CPU devices."""
    mesh, on_cpu = _planning_mesh(config, devices)
    if on_cpu:
        config = _without_bfloat16(config)
    model = Model(config, mesh)
    optimizer = make_optimizer(config.train)
    opt_shardings, abstract_opt_state = opt_state_layout(optimizer, model)
    abstract_params = model.abstract_params()
    batch = abstract_batch(config, mesh)
    step = make_train_step(model, optimizer, opt_shardings)
    options = CPU_COMPILER_OPTIONS if on_cpu else None
    lowered = step.lower(abstract_params, abstract_opt_state, batch)
    analysis = lowered.compile(compiler_options=options).memory_analysis()

    parameters = shard_bytes(abstract_params)
    gradients = parameters  # one gradient per parameter, placed like it
    layer_inputs = saved_layer_input_bytes(config)
    host_offload = layer_inputs if offloads_layer_inputs(config.memory.remat) else 0
    left_on_device = host_offload if on_cpu else 0  # see the module docstring
    return MemoryPlan(
        parameters=parameters,
        gradients=gradients,
        optimizer_state=shard_bytes(abstract_opt_state),
        inputs=shard_bytes(batch),
        temporaries=max(analysis.temp_size_in_bytes - gradients - left_on_device, 0),
        saved_layer_inputs=layer_inputs,
        host_offload=host_offload,
        budget=int(budget_gib * GIB),
    )


def state_bytes(config: Config, devices=None) -> int:
    """Parameters + gradients + optimizer state per device: what any sequence
    length needs before its first activation. Nothing is compiled."""
    mesh, _ = _planning_mesh(config, devices)
    model = Model(config, mesh)
    _, abstract_opt_state = opt_state_layout(make_optimizer(config.train), model)
    return 2 * shard_bytes(model.abstract_params()) + shard_bytes(abstract_opt_state)


def _planning_mesh(config: Config, devices):
    if devices is None:
        devices = jax.devices("cpu")[: config.mesh.size]
    mesh = make_mesh(config.mesh, devices)
    return mesh, mesh.devices.flat[0].platform == "cpu"


def _without_bfloat16(config: Config) -> Config:
    """bfloat16 dtypes replaced by float16: same bytes, not widened by XLA:CPU."""
    train = config.train
    swap = {"bfloat16": "float16"}
    return dataclasses.replace(
        config,
        train=dataclasses.replace(
            train,
            param_dtype=swap.get(train.param_dtype, train.param_dtype),
            compute_dtype=swap.get(train.compute_dtype, train.compute_dtype),
        ),
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


def format_plan(result: MemoryPlan, config: Config) -> str:
    """The plan as a short table in GiB, headed by what was planned."""
    m, t, mem = config.mesh, config.train, config.memory
    heads = config.heads_per_stage
    lines = [
        f"seq_len {t.seq_len:,} x batch {t.batch_size} on mesh data={m.data} fsdp={m.fsdp} sp={m.sp}; "
        f"{t.compute_dtype} compute, {t.param_dtype} parameters",
        f"remat {mem.remat}, mlp_tile {mem.mlp_tile or 'off'}, loss_tile {mem.loss_tile or 'off'}, "
        f"attention heads per stage {heads} of {config.model.num_attention_heads}",
    ]
    unit, size = ("GiB", GIB) if result.device_total >= GIB else ("MiB", 2**20)
    lines.append(f"per device                 {unit}")
    rows = [
        ("parameters", result.parameters),
        ("gradients", result.gradients),
        ("optimizer state", result.optimizer_state),
        ("inputs", result.inputs),
        ("temporaries (peak)", result.temporaries),
    ]
    if result.saved_layer_inputs:
        rows.append(("  of which layer inputs", result.saved_layer_inputs - result.host_offload))
    rows += [("device total", result.device_total), ("host (offloaded)", result.host_offload)]
    lines += [f"  {name:<24}{value / size:>8.2f}" for name, value in rows]
    verdict = "fits" if result.fits else f"does NOT fit (over by {(result.device_total - result.budget) / GIB:.2f} GiB)"
    lines.append(f"budget {result.budget / GIB:g} GiB per device: {verdict}")
    return "\n".join(lines)
