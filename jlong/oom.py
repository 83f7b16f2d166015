"""Out of device memory, explained: the planner's per-device figures and the
memory settings that would lower them."""

from __future__ import annotations

from jlong.config import Config
from jlong.errors import JlongError
from jlong.model.remat import remat_policy
from jlong.plan import plan
from jlong.targets import GIB, PlanTarget

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


def lower_memory_settings(config: Config) -> list[str]:
    """The memory knobs this config does not use yet, in the order they pay."""
    memory, mesh, model = config.memory, config.mesh, config.model
    local = config.train.seq_len // mesh.sp
    suggestions = []
    if not remat_policy(memory.remat).offloads_layer_inputs:
        suggestions.append("memory.remat=offload_inputs")
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
