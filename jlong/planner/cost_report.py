"""The step cost as text: a few lines headed by what it is (an estimate)."""

from __future__ import annotations

from jlong.planner.step_cost import CPU_NOTE, ESTIMATE_NOTE, StepCost


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def _share(parts: dict, total: float) -> str:
    ordered = sorted(parts.items(), key=lambda item: -item[1])
    return ", ".join(f"{name} {value / total:.0%}" for name, value in ordered if total and value / total >= 0.005)


def _size(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def format_cost(cost: StepCost | None) -> str:
    """The step cost as a few lines, headed by what it is."""
    if cost is None:
        return f"step cost: {CPU_NOTE}"
    lines = [
        f"step cost, {ESTIMATE_NOTE}:",
        f"  step time {_duration(cost.step_time_s)} ({cost.step_time_s:,.1f} s); {cost.tokens_per_s:,.0f} tokens/s "
        f"for the mesh, {cost.tokens_per_s / cost.devices:,.1f} per device; MFU {cost.mfu:.1%}",
        f"  FLOPs per device: executed {cost.executed_flops:.3g} ({_share(cost.flops_by_kind, cost.executed_flops)}), "
        f"model {cost.model_flops:.3g}; executed / model {cost.recompute_factor:.2f}",
        f"  time: {_share(cost.time_by_kind, sum(cost.time_by_kind.values()))}",
        "  collectives per device: " + (", ".join(
            f"{kind} {_size(value)}" for kind, value in sorted(cost.collective_bytes_by_kind.items()) if value
        ) or "none"),
        f"  host <-> device {_size(cost.host_bytes)} per device; {cost.kernels:,.0f} kernel launches",
    ]
    if cost.unpriced_custom_calls:
        calls = ", ".join(f"{target} x {entry['calls']:,.0f} ({_size(entry['bytes'])})"
                          for target, entry in cost.unpriced_custom_calls.items())
        lines.append(f"  custom calls the planner cannot price, counted at their memory traffic only (their FLOPs "
                     f"are missing, so the time is a lower bound): {calls}")
    if cost.unmeasured_kernels:
        kernels = ", ".join(f"{name} x {entry['calls']:,.0f} (as {entry['priced_as']}, "
                            f"{cost.efficiency.of_kind(entry['priced_as']):g})"
                            for name, entry in cost.unmeasured_kernels.items())
        lines.append(f"  GPU kernels never run on a GPU (no race recorded for them), priced without a measurement at "
                     f"a measured sibling's rate, so the time rests on them untested: {kernels}")
    if cost.unknown_trip_loops:
        lines.append(f"  {cost.unknown_trip_loops} loops have a trip count the compiler cannot know; each is counted "
                     "once, so the time is a lower bound")
    gpu = cost.gpu
    lines.append(f"  assumes {gpu.name}: {gpu.peak_bf16_flops / 1e12:,.0f} TFLOP/s bf16 dense, HBM "
                 f"{gpu.hbm_bytes_per_s / 1e12:g} TB/s, NVLink {gpu.nvlink_bytes_per_s / 1e9:g} GB/s, InfiniBand "
                 f"{gpu.infiniband_bytes_per_s / 1e9:g} GB/s, PCIe {gpu.pcie_bytes_per_s / 1e9:g} GB/s per GPU and "
                 f"direction; efficiencies {cost.efficiency.describe()} (--efficiency KEY=VALUE changes them)")
    return "\n".join(lines)
