"""Memory that runs out, explained in one line: a run out of device memory
(with the planner's figures), a plan over its device or host budget, and in
both cases the memory settings that would lower what is over."""

from __future__ import annotations

from jlong.config import Config
from jlong.errors import JlongError
from jlong.model.remat import remat_policy
from jlong.planner.memory import MemoryPlan, plan
from jlong.planner.targets import GIB, PlanTarget

_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def is_out_of_memory(error: Exception) -> bool:
    return any(marker in str(error) for marker in _MARKERS)


def out_of_memory_error(config: Config, where: str, devices, capacity_bytes: int | None) -> JlongError:
    """One line: what ran out, what the plan says each device needs, and what to change."""
    estimate = _plan_summary(config, devices, capacity_bytes)
    knobs = "; ".join(lower_memory_settings(config)) or "a shorter train.seq_len or more devices"
    return JlongError(f"out of device memory {where}{estimate}; settings that lower it: {knobs}")


def _plan_summary(config: Config, devices, capacity_bytes: int | None) -> str:
    budget_gib = capacity_bytes / GIB if capacity_bytes else None
    try:
        result = plan(config, PlanTarget(budget_gib=budget_gib), devices=devices)
    except Exception as err:  # the estimate is a courtesy: never mask the out-of-memory itself
        return f" (no plan: {type(err).__name__})"
    parts = ", ".join(
        f"{name} {value / GIB:.2f}"
        for name, value in (
            ("parameters", result.parameters),
            ("gradients", result.gradients),
            ("optimizer state", result.optimizer_state),
            ("temporaries", result.temporaries),
        )
    )
    capacity = f" of the device's {capacity_bytes / GIB:.2f} GiB" if capacity_bytes else ""
    return f": the plan needs {result.device_total / GIB:.2f} GiB per device ({parts}){capacity}"


def over_budget_error(result: MemoryPlan, config: Config) -> JlongError:
    """One line: which budget a plan is over, by how much, and what would lower it."""
    reasons, knobs = [], []
    if not result.fits_device:
        reasons.append(f"{result.device_total / GIB:.2f} GiB per device is {(result.device_total - result.budget) / GIB:.2f} "
                       f"GiB over the device budget of {result.budget / GIB:.2f} GiB")
        knobs += lower_memory_settings(config)
    if not result.fits_host:
        over = (result.host_per_node - result.host_budget_per_node) / GIB
        reasons.append(f"{result.host_per_node / GIB:,.1f} GiB of host memory per node is {over:,.1f} GiB over the "
                       f"host budget of {result.host_budget_per_node / GIB:,.0f} GiB")
        knobs += lower_host_settings(config)
    knobs = list(dict.fromkeys(knobs)) or ["a shorter train.seq_len or more devices"]
    return JlongError(f"at train.seq_len={config.train.seq_len:,}, {' and '.join(reasons)}; "
                      f"settings that lower it: {'; '.join(knobs)}")


def lower_host_settings(config: Config) -> list[str]:
    """The knobs that take bytes off the host, in the order they cost least."""
    if not remat_policy(config.memory.remat).offloads_layer_inputs:
        return []
    knobs = [f"memory.layers_per_checkpoint={k}" for k in _larger_groups(config)[:1]]
    return [*knobs, "memory.remat=save_inputs (layer inputs stay on the devices)",
            "memory.remat=full (no layer inputs kept)"]


def _larger_groups(config: Config) -> list[int]:
    """layers_per_checkpoint values above the config's that divide its layers."""
    layers, k = config.model.num_hidden_layers, config.memory.layers_per_checkpoint
    return [g for g in range(k + 1, layers + 1) if layers % g == 0]


def lower_memory_settings(config: Config) -> list[str]:
    """The memory knobs this config does not use yet, in the order they pay."""
    memory, mesh, model = config.memory, config.mesh, config.model
    local = config.shard_tokens
    suggestions = []
    if not remat_policy(memory.remat).offloads_layer_inputs:
        suggestions.append("memory.remat=offload_inputs")
    if config.lora is not None:  # its optimizer holds the adapters alone: the base is what weighs
        if config.lora.base_dtype == "compute":
            suggestions.append("lora.base_dtype=nf4 (the frozen base in 4 bits)")
    elif not memory.optimizer_offload:
        suggestions.append("memory.optimizer_offload=true")
    if not memory.loss_tile:
        suggestions.append(f"memory.loss_tile={_divisor_near(local, 1024)}")
    if not memory.mlp_tile:
        suggestions.append(f"memory.mlp_tile={_divisor_near(local, 2048)}")
    if config.heads_per_stage > mesh.sp:
        suggestions.append(f"attention.heads_per_stage={mesh.sp}")
    larger_sp = [c for c in (2 * mesh.sp, 4 * mesh.sp) if model.num_attention_heads % c == 0]
    if larger_sp:
        suggestions.append(f"mesh.sp={larger_sp[0]} (on {mesh.size // mesh.sp * larger_sp[0]} devices)")
    return suggestions


def _divisor_near(n: int, target: int) -> int:
    return min((t for t in range(1, n + 1) if n % t == 0), key=lambda t: abs(t - target))
