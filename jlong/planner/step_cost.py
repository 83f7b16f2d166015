"""What a train step costs, read from its compiled program: an estimate.

Three parts: `jlong.planner.schedule` walks the program in schedule order,
`jlong.planner.pricing` prices each launch, and this module assembles the
result (`StepCost`, whose fields give the JSON keys); `jlong.planner.cost_report`
writes it as text.

Nothing runs. The optimized, scheduled HLO (`compiled.as_text()`) lists
every kernel a device launches, in order, with its shapes; loops carry
their trip counts. Each is priced on a roofline of the target GPU:

- a kernel takes one launch (`launch_us`) plus max(FLOPs / (peak x
  efficiency), HBM bytes / (HBM bandwidth x `hbm`)); matmuls (dots in
  fusions, cuBLAS) run at `gemm` of the bf16 peak, cuDNN attention at
  `attention_fwd` / `attention_bwd`;
- a collective moves its wire bytes per device (all-gather (n-1) x its
  input, reduce-scatter and all-to-all (n-1)/n of it, all-reduce twice
  that, a permute all of it) over NVLink when its groups stay inside a
  node, over InfiniBand otherwise, at `links` (`all_to_all` for
  all-to-all);
- a copy to or from host memory moves its bytes over PCIe at `links`;
- asynchronous work (collectives, host copies) runs beside the kernels from
  its start to its done, one stream per kind, in schedule order: the step
  waits at a done only for what is still in flight. Overlap across loop
  iterations is not modelled; a loop whose trip count the compiler could
  not know (a `while` with data-dependent bounds) is counted once and the
  report says so; a conditional costs its costliest branch (the ring
  kernel's block skipping is counted as if no block were skipped);
- a custom call is priced when its kind is known (cuDNN attention, cuBLAS
  gemms, jlong's own GPU kernels at their kinds' efficiencies); any other (a
  Pallas or Triton kernel) is counted at its memory traffic only, and the
  report names it with its calls and bytes;
- one of jlong's GPU kernels that has never run on a GPU (no race recorded
  for it: `jlong.kernel_runs`) is priced at a measured sibling's rate, and
  the report names it: the estimate rests on a kernel nobody has timed.

FLOPs are counted per device: a dot is 2 x output elements x contracted
size; a cuDNN forward 4 x B x H x Sq x Skv x d, its backward 10 x (five
matmuls: the scores are recomputed), both times the visible fraction of a
causal mask; elementwise ops one per output element. Model FLOPs are the
family's (`jlong.families.Family.flops_per_token`: 6 x parameters x tokens
+ causal attention, no recompute), and a LoRA run's take out the frozen
base's weight gradients (4 x its parameters, 6 x the adapters':
`jlong.planner.flops`); executed / model is the recompute factor, and MFU is model
FLOPs over the estimated time at the dense bf16 peak.
"""

from __future__ import annotations

import dataclasses

from jlong.kernel_runs import KernelRuns
from jlong.planner.flops import model_flops_per_token
from jlong.planner.hlo import HloModule
from jlong.planner.memory import CompiledStep
from jlong.planner.pricing import Efficiency, Pricer
from jlong.planner.schedule import ScheduleWalk
from jlong.planner.targets import GPUS, GpuModel

ESTIMATE_NOTE = ("an estimate read from the compiled program (a roofline over its kernels, collectives and host "
                 "copies in schedule order), not a measurement")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """The estimated cost of one train step; counts are per device."""

    gpu: GpuModel
    step_time_s: float
    tokens_per_step: int
    devices: int
    executed_flops: float
    flops_by_kind: dict  # matmul, attention (cuDNN), other
    model_flops: float
    time_by_kind: dict  # seconds of kernels by kind, launches, and waits for async work
    collective_bytes: float
    collective_bytes_by_kind: dict  # "all-to-all nvlink": bytes
    host_bytes: float
    hbm_bytes: float
    kernels: float
    unknown_trip_loops: int
    unpriced_custom_calls: dict  # target -> {"calls", "bytes"}: kernels priced at their memory traffic only
    # jlong's GPU kernels never run on a GPU -> {"calls", "priced_as"}: priced at a measured sibling's rate
    unmeasured_kernels: dict
    efficiency: Efficiency

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s else 0.0

    @property
    def recompute_factor(self) -> float:
        return self.executed_flops / self.model_flops if self.model_flops else 0.0

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.devices

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time_s * self.gpu.peak_bf16_flops) if self.step_time_s else 0.0

    def as_dict(self) -> dict:
        """The JSON of `jlong plan --json`: every field and derived rate (COST_KEYS), and the note."""
        values = {key: getattr(self, key) for key in _FIELD_KEYS + _DERIVED_KEYS}
        return {**values, "cost_gpu": self.gpu.name, "efficiency": dataclasses.asdict(self.efficiency),
                "cost_note": ESTIMATE_NOTE}


# The JSON keys, derived from the result: its fields (but those that only
# describe the setting), its derived rates, and the GPU and efficiencies assumed.
_SETTING = ("gpu", "tokens_per_step", "devices", "efficiency")
_FIELD_KEYS = tuple(f.name for f in dataclasses.fields(StepCost) if f.name not in _SETTING)
_DERIVED_KEYS = ("tokens_per_s", "tokens_per_s_per_device", "mfu", "recompute_factor")
COST_KEYS = (*_FIELD_KEYS, *_DERIVED_KEYS, "cost_gpu", "efficiency")


def cost_dict(cost: StepCost | None) -> dict:
    """The JSON keys of a step cost; None values and the reason when there is none."""
    if cost is None:
        return {**dict.fromkeys(COST_KEYS), "cost_note": CPU_NOTE}
    return cost.as_dict()


def estimate(module: HloModule, *, gpu: GpuModel, efficiency: Efficiency, node_of: list[int], tokens_per_step: int,
             model_flops_per_device: float, runs: KernelRuns | None = None) -> StepCost:
    """Prices a compiled program on `gpu`; `node_of[p]` is the node of the
    device that runs partition p; `runs` says which of jlong's GPU kernels
    have run on a GPU (the committed record by default)."""
    tally = ScheduleWalk(module, Pricer(module, gpu, efficiency, node_of, runs)).run(module.entry)
    time_by_kind = {key: value for key, value in tally.busy_s.items() if value}
    time_by_kind.update({f"waiting for {key}": value for key, value in tally.waited_s.items() if value})
    return StepCost(
        gpu=gpu,
        step_time_s=tally.time_s,
        tokens_per_step=tokens_per_step,
        devices=len(node_of),
        executed_flops=sum(tally.flops.values()),
        flops_by_kind=dict(tally.flops),
        model_flops=model_flops_per_device,
        time_by_kind=time_by_kind,
        collective_bytes=sum(tally.collective_bytes.values()),
        collective_bytes_by_kind={f"{kind} {link}": value for (kind, link), value in tally.collective_bytes.items()},
        host_bytes=tally.host_bytes,
        hbm_bytes=tally.hbm_bytes,
        kernels=tally.launches,
        unknown_trip_loops=tally.unknown_trip_loops,
        unpriced_custom_calls={target: {"calls": calls, "bytes": moved}
                               for target, (calls, moved) in sorted(tally.unpriced.items())},
        unmeasured_kernels={name: {"calls": calls, "priced_as": kind}
                            for name, (calls, kind) in sorted(tally.unmeasured.items())},
        efficiency=efficiency,
    )


CPU_NOTE = ("no step cost on the cpu target: it is read from the XLA:GPU program (plan for the h100 target, "
            "which needs pip install 'jlong[gpu-plan]')")


def step_cost(step: CompiledStep, efficiency: Efficiency = Efficiency()) -> StepCost | None:
    """The estimated cost of a step compiled by `jlong.planner.memory.compile_train_step`
    for a GPU target, priced on that GPU; None for the cpu target, whose
    XLA:CPU program (blockwise attention loops with data-dependent bounds,
    CPU fusion) says little about a GPU's."""
    if step.on_cpu:
        return None
    config = step.program.config
    gpu = GPUS[step.target.name]
    devices = list(step.program.mesh.devices.flat)
    node_of = [device.process_index for device in devices]  # compile-only GPUs: one process per node
    tokens = config.train.batch_size * config.train.seq_len
    model_flops = model_flops_per_token(config) * tokens / len(devices)
    return estimate(step.hlo, gpu=gpu, efficiency=efficiency, node_of=node_of,
                    tokens_per_step=tokens, model_flops_per_device=model_flops)
