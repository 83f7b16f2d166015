"""Per-device memory of the configured train step, compiled ahead of time.

Nothing is allocated: the step is lowered with `jax.ShapeDtypeStruct`
parameters, optimizer state and batch, compiled for the configured mesh on
a `PlanTarget`, and XLA's memory analysis says what each device needs.

GPU targets (h100, h200, b200) compile with XLA:GPU for compile-only devices
(`jlong.planner.targets`): the program a real node would run, cuDNN attention and
host offload included. Device bytes are its arguments and temporaries (and
outputs not aliased to a donated argument); host bytes are what the compiler
places in host memory.

The cpu target compiles for virtual CPU devices (any machine, no plugin).
Three corrections bring its figures toward the GPU program:
- XLA:CPU widens bfloat16 buffers to float32, so bfloat16 is planned as
  float16, which has the same size and which the CPU keeps as it is;
- it also runs 16-bit matmuls in float32; the pass that rewrites them is
  switched off for the plan's compile (`CPU_COMPILER_OPTIONS`);
- host offload compiles to nothing on CPU, so the offloaded layer inputs sit
  in the temporaries; they are counted from the remat policy and the shapes,
  reported as host bytes, and taken out of the device's temporaries (with
  `offload_attention`, the attention outputs and log-sum-exps too).

A LoRA run (`lora:`) holds a frozen base (in the compute dtype, or in NF4:
4-bit codes, packed two to a byte as XLA:GPU packs them, and a scale per
64 inputs) beside its adapters; only the adapters have gradients and
optimizer state, so `gradients` counts theirs and `frozen_parameters` says
how much of `parameters` is the base.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jlong.attention.methods import method_of
from jlong.config import Config, with_values
from jlong.families import family_of
from jlong.jax_private import private
from jlong.model.remat import remat_policy
from jlong.parallel.placement import make_mesh
from jlong.planner.hlo import HloModule, parse_module
from jlong.planner.pricing import kernel_call_cost
from jlong.planner.targets import GIB, PlanTarget, node_shape
from jlong.program.train_program import TrainProgram

# XLA:CPU computes 16-bit matmuls in float32 (converted operands, float32
# result); a GPU does not. Without this pass the CPU keeps them 16-bit.
CPU_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "change-op-data-type"}


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (host: per device and per node). `temporaries` is
    XLA's peak scratch minus the gradients: the activations kept for the
    backward pass and the working buffers of the busiest moment.
    `saved_layer_inputs` is the part of it (or of `host_offload`) that the
    remat policy keeps per layer, counted from the shapes. With the optimizer
    offloaded, `parameters` and `gradients` are the compute-dtype copies the
    step holds, and `host_states` (part of `host_offload`) the master
    parameters and optimizer state in host memory. `cudnn_workspace` is what
    cuDNN attention needs beside XLA's buffers (`cudnn_workspace_bytes`),
    part of `device_total`. `frozen_parameters` is the part of `parameters`
    that trains not (a LoRA run's base, in its dtype; 0 without LoRA):
    it has no gradient and no optimizer state."""

    target: str
    compiler: str
    parameters: int
    gradients: int
    optimizer_state: int
    inputs: int
    temporaries: int
    saved_layer_inputs: int
    cudnn_workspace: int
    host_offload: int
    host_states: int
    budget: int
    host_budget_per_node: int
    devices_per_node: int
    frozen_parameters: int = 0

    @property
    def trainable_parameters(self) -> int:
        """Bytes per device of what trains: every parameter, or a LoRA run's adapters."""
        return self.parameters - self.frozen_parameters

    @property
    def device_total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer_state + self.inputs + self.temporaries
                + self.cudnn_workspace)

    @property
    def host_per_node(self) -> int:
        return self.host_offload * self.devices_per_node

    @property
    def fits_device(self) -> bool:
        return self.device_total <= self.budget

    @property
    def fits_host(self) -> bool:
        return self.host_per_node <= self.host_budget_per_node

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def exceeded(self) -> list[str]:
        """The budgets this plan is over: "device", "host" (empty when it fits)."""
        return [name for name, ok in (("device", self.fits_device), ("host", self.fits_host)) if not ok]

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "device_total": self.device_total, "host_per_node": self.host_per_node,
                "fits_device": self.fits_device, "fits_host": self.fits_host, "fits": self.fits}


@dataclasses.dataclass(frozen=True)
class CompiledStep:
    """A training program's step, compiled for a plan."""

    program: TrainProgram  # its config as compiled (bfloat16 swapped for float16 on CPU)
    compiled: jax.stages.Compiled
    target: PlanTarget
    own_devices: list | None  # a running program's devices, when it compiled for them
    forward_only: bool = False  # the eval program (`jlong eval`): no gradients, no optimizer update

    @property
    def on_cpu(self) -> bool:
        return self.program.mesh.devices.flat[0].platform == "cpu"

    @functools.cached_property
    def text(self) -> str:
        """The optimized program's text, printed once (megabytes for a large program)."""
        return self.compiled.as_text()

    @functools.cached_property
    def hlo(self) -> HloModule:
        """The optimized program, read (`jlong.planner.hlo`)."""
        return parse_module(self.text)


def compile_train_step(config: Config, target: PlanTarget = PlanTarget(), devices=None, *,
                       forward_only: bool = False) -> CompiledStep:
    """Compiles the training program of `config` for its mesh on `target` (or
    on `devices`, a running program's own) with abstract inputs; with
    `forward_only`, its eval program (`TrainProgram.eval_step`) instead."""
    mesh = _planning_mesh(config, target, devices)
    on_cpu = mesh.devices.flat[0].platform == "cpu"
    program = TrainProgram(_without_bfloat16(config) if on_cpu else config, mesh)
    lowered = program.lower_eval() if forward_only else program.lower()
    if on_cpu:
        compiled = lowered.compile(CPU_COMPILER_OPTIONS)
    else:
        # A compile-only GPU executable cannot be loaded back from jax's
        # persistent compilation cache (there is no device to load it on), so
        # it is never written there.
        with private("jax._src.config", "persistent_cache_min_compile_time_secs")(float("inf")):
            compiled = lowered.compile()
    return CompiledStep(program, compiled, target, devices, forward_only)


def plan(config: Config, target: PlanTarget = PlanTarget(), devices=None) -> MemoryPlan:
    """Compiles the train step of `config` for its mesh and reports per-device
    bytes against the target's budgets. `devices` (default: the target's)
    may be a running program's own, for its out-of-memory report."""
    return plan_of(compile_train_step(config, target, devices))


def plan_of(step: CompiledStep) -> MemoryPlan:
    """The memory plan of a step compiled by `compile_train_step`."""
    program, target, devices = step.program, step.target, step.own_devices
    config = program.config
    analysis = step.compiled.memory_analysis()
    parameters = shard_bytes(program.abstract_compute_params)
    # One gradient per trained parameter, placed like it: a LoRA run's adapters alone.
    gradients = trainable = shard_bytes(program.saved(program.abstract_compute_params))
    host_states = host_state_bytes(program)
    device_states = shard_bytes(program.abstract_opt_state, lambda leaf: not in_host_memory(program, leaf))
    layer_inputs = saved_layer_input_bytes(config)
    if step.forward_only:  # no gradients, no optimizer state, nothing kept for a backward pass
        gradients = device_states = layer_inputs = 0
        host_states = shard_bytes(program.abstract_params, lambda leaf: in_host_memory(program, leaf))
    if step.on_cpu and step.forward_only:
        host_offload, temporaries = host_states, analysis.temp_size_in_bytes
    elif step.on_cpu:  # see the module docstring
        offloaded_inputs = saved_layer_input_bytes(config, lambda policy: policy.offloads_layer_inputs)
        offloaded = offloaded_inputs + offloaded_attention_bytes(config)
        host_offload = offloaded + host_states
        temporaries = analysis.temp_size_in_bytes - offloaded
    else:
        host_offload = analysis.host_temp_size_in_bytes + analysis.host_argument_size_in_bytes
        temporaries = analysis.temp_size_in_bytes + max(analysis.output_size_in_bytes - analysis.alias_size_in_bytes, 0)
    # An offloaded optimizer's compute copies of the parameters are made inside the step.
    in_temporaries = gradients + (parameters if program.optimizer.makes_compute_copy else 0)
    if devices is None:
        _, devices_per_node = node_shape(config.mesh.size, target.gpus_per_node)
        compiler = target.compiler()
    else:  # a running program's devices: a process is a node
        devices_per_node = sum(d.process_index == devices[0].process_index for d in devices)
        compiler = f"{devices[0].device_kind} (this machine)"
    return MemoryPlan(
        target=target.name,
        compiler=compiler,
        parameters=parameters,
        gradients=gradients,
        optimizer_state=device_states,
        inputs=shard_bytes(program.abstract_batch),
        temporaries=max(temporaries - in_temporaries, 0),
        saved_layer_inputs=layer_inputs,
        cudnn_workspace=0 if step.on_cpu else cudnn_workspace_bytes(step.hlo),
        host_offload=host_offload,
        host_states=host_states,
        budget=int(target.device_budget_gib(config.train.gpu_memory_fraction) * GIB),
        host_budget_per_node=int(target.host_budget_gib * GIB),
        devices_per_node=devices_per_node,
        frozen_parameters=parameters - trainable,
    )


def cudnn_workspace_bytes(module: HloModule) -> int:
    """The largest workspace one attention kernel call of the program needs
    beyond what the compiled program shows, as its kernel prices it (cuDNN's,
    which deviceless compilation leaves out: `jlong.attention.cudnn.price_call`).
    Calls run one after another, so the largest is what the peak holds at most."""
    costs = (kernel_call_cost(call, computation) for computation in module.computations.values()
             for call in computation.instructions)
    return max((cost.workspace_bytes for cost in costs if cost is not None), default=0)


def state_bytes(config: Config, target: PlanTarget = PlanTarget(), devices=None) -> int:
    """Parameters + gradients + optimizer state per device: what any sequence
    length needs before its first activation. Nothing is compiled."""
    program = TrainProgram(config, _planning_mesh(config, target, devices))
    device_states = shard_bytes(program.abstract_opt_state, lambda leaf: not in_host_memory(program, leaf))
    parameters = program.abstract_compute_params
    return shard_bytes(parameters) + shard_bytes(program.saved(parameters)) + device_states


def in_host_memory(program: TrainProgram, leaf) -> bool:
    """Whether a leaf of the program's parameters or optimizer state lives in host memory between steps."""
    return program.optimizer.in_host_memory(leaf)


def host_state_bytes(program: TrainProgram) -> int:
    """Master parameters and optimizer state per device in host memory (0 unless offloaded)."""
    return shard_bytes((program.abstract_params, program.abstract_opt_state), lambda leaf: in_host_memory(program, leaf))


def _planning_mesh(config: Config, target: PlanTarget, devices):
    if devices is None:
        devices = target.devices(config.mesh.size)
    return make_mesh(config.mesh, devices)


def _without_bfloat16(config: Config) -> Config:
    """bfloat16 dtypes replaced by float16: same bytes, not widened by XLA:CPU."""
    train = config.train
    swap = {"bfloat16": "float16"}
    dtypes = {key: swap.get(getattr(train, key), getattr(train, key)) for key in ("param_dtype", "compute_dtype")}
    return with_values(config, train=dtypes)


def shard_bytes(tree, where: Callable[[jax.ShapeDtypeStruct], bool] = lambda leaf: True) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the
    largest shard); of the leaves `where` picks. 4-bit types (a QLoRA base's
    codes) count half a byte an element, packed as XLA:GPU packs them."""
    total = 0
    for leaf in filter(where, jax.tree.leaves(tree)):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.ceil(math.prod(shape) * element_bits(leaf.dtype) / 8)
    return total


def element_bits(dtype) -> int:
    """Bits per element: 4 for int4, uint4 and float4 (numpy's itemsize says a byte), else 8 x itemsize."""
    dtype = jnp.dtype(dtype)
    return 4 if dtype.name in ("int4", "uint4", "float4_e2m1fn") else 8 * dtype.itemsize


def _local_tokens(config: Config) -> int:
    """Tokens of one device's sequence shard, over the sequences it holds."""
    mesh, train = config.mesh, config.train
    return train.batch_size // (mesh.data * mesh.fsdp) * config.shard_tokens


def saved_layer_input_bytes(config: Config, where: Callable = lambda policy: policy.keeps_layer_inputs) -> int:
    """One [B, S/(ring x sp), D] layer input per `layers_per_checkpoint` layers in the
    compute dtype, on each device, for the layers whose policy keeps layer inputs
    (`where`: whose policy passes it, for example moves them to host memory)."""
    kept = sum(s.layers // s.layers_per_checkpoint for s in config.remat_segments if where(remat_policy(s.remat)))
    return kept * layer_input_bytes_per_layer(config)


def layer_input_bytes_per_layer(config: Config) -> int:
    """One layer's input, [B, S/(ring x sp), D] in the compute dtype, per device."""
    return _local_tokens(config) * config.model.hidden_size * jnp.dtype(config.train.compute_dtype).itemsize


def attention_output_bytes_per_layer(config: Config) -> int:
    """One layer's attention output (the compute dtype) and float32 log-sum-exp, per device."""
    model = config.model
    per_head = model.dim_per_head * jnp.dtype(config.train.compute_dtype).itemsize + 4
    return _local_tokens(config) * model.num_attention_heads * per_head


def offloaded_attention_bytes(config: Config) -> int:
    """The attention outputs and log-sum-exps per device of the layers whose policy moves them to host memory."""
    layers = sum(s.layers for s in config.remat_segments if remat_policy(s.remat).offloads_attention)
    return layers * attention_output_bytes_per_layer(config)


def describe_layers(config: Config) -> str:
    """'offload_inputs (one input per 2 layers)', or per run of layers: 'offload_attention for layers
    0-9, offload_inputs for layers 10-31'."""
    def described(segment) -> str:
        k = segment.layers_per_checkpoint
        return segment.remat + (f" (one input per {k} layers)" if k > 1 else "")

    segments = config.remat_segments
    if len(segments) == 1:
        return described(segments[0])
    parts, first = [], 0
    for segment in segments:
        last = first + segment.layers - 1
        parts.append(f"{described(segment)} for " + (f"layers {first}-{last}" if last > first else f"layer {first}"))
        first += segment.layers
    return ", ".join(parts)


def describe_lora(config: Config) -> str:
    """One line of a LoRA run's plan: the adapters, and the base's dtype."""
    from jlong.lora.targets import lora_settings

    lora, train = lora_settings(config.lora, config.model), config.train
    base = ("NF4 (4-bit codes, packed, and a scale per 64 inputs)" if lora.base_dtype == "nf4"
            else train.compute_dtype)
    targets = ", ".join(config.lora.targets)
    return (f"LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {len(lora.targets)} matrices of the layers "
            f"({targets}); the frozen base in {base}, no gradient; adapters and their AdamW state in "
            f"{train.param_dtype}")


def describe_latent_exchange(config: Config) -> str | None:
    """One line of the plan where keys and values could move between devices as a latent (multi-head latent
    attention): which the method moves, by the values per token of each (`LatentProjection.moves_latent`)."""
    family = family_of(config.model)
    projection = family.attention_projection(config.model)
    exchange = method_of(config).latent_exchange(config)
    if not projection.latent_width or exchange is None:
        return None
    where, heads = exchange
    specs = family.layer_params(config.model)
    latent, keys_values = projection.latent_width, heads * projection.head_width(specs)
    moved = "the latent" if projection.moves_latent(specs, heads) else "the up-projected keys and values"
    return (f"keys and values move as {moved} ({where}): {latent:,} values per token for the latent, "
            f"{keys_values:,} for the {heads} head{'s' if heads > 1 else ''} a device receives")


def format_plan(result: MemoryPlan, config: Config) -> str:
    """The plan as a short table in GiB, headed by what was planned and by what."""
    m, t, mem = config.mesh, config.train, config.memory
    heads = config.heads_per_stage
    lines = [
        f"target {result.target}: {result.compiler}",
        f"seq_len {t.seq_len:,} x batch {t.batch_size} on mesh data={m.data} fsdp={m.fsdp} ring={m.ring} sp={m.sp}; "
        f"{t.compute_dtype} compute, {t.param_dtype} parameters",
        f"remat {describe_layers(config)}{', optimizer in host memory' if mem.optimizer_offload else ''}, "
        f"mlp_tile {mem.mlp_tile or 'off'}, loss_tile {mem.loss_tile or 'off'}, "
        f"attention {config.attention.sp_method} in stages of {heads} of {config.model.num_attention_heads} heads",
    ]
    if config.lora is not None:
        lines.append(describe_lora(config))
    if latent := describe_latent_exchange(config):
        lines.append(latent)
    unit, size = ("GiB", GIB) if result.device_total >= GIB else ("MiB", 2**20)
    lines.append(f"per device                 {unit}")
    rows = [("parameters", result.parameters)]
    if result.frozen_parameters:
        rows += [("  of which frozen base", result.frozen_parameters),
                 ("  of which adapters", result.trainable_parameters)]
    rows += [
        ("gradients", result.gradients),
        ("optimizer state", result.optimizer_state),
        ("inputs", result.inputs),
        ("temporaries (peak)", result.temporaries),
    ]
    if result.cudnn_workspace:
        rows.append(("cuDNN workspace", result.cudnn_workspace))
    if result.saved_layer_inputs and not result.host_offload:
        rows.append(("  of which layer inputs", result.saved_layer_inputs))
    rows += [("device total", result.device_total), ("host (offloaded)", result.host_offload)]
    if result.host_states:
        rows.append(("  of which master + optimizer", result.host_states))
    lines += [f"  {name:<24}{value / size:>8.2f}" for name, value in rows]
    over = (result.device_total - result.budget) / GIB
    verdict = "fits" if result.fits_device else f"does NOT fit (over by {over:.2f} GiB)"
    lines.append(f"device budget {result.budget / GIB:.2f} GiB per device: {verdict}")
    over = (result.host_per_node - result.host_budget_per_node) / GIB
    verdict = "fits" if result.fits_host else f"does NOT fit (over by {over:,.1f} GiB)"
    lines.append(f"host {result.host_per_node / GIB:,.1f} GiB per node of {result.devices_per_node} devices, "
                 f"budget {result.host_budget_per_node / GIB:,.0f} GiB: {verdict}")
    return "\n".join(lines)
