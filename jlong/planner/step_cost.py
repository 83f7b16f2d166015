"""What a train step costs, read from its compiled program: an estimate.

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
  gemms); any other (a Pallas or Triton kernel) is counted at its memory
  traffic only, and the report names it with its calls and bytes.

FLOPs are counted per device: a dot is 2 x output elements x contracted
size; a cuDNN forward 4 x B x H x Sq x Skv x d, its backward 10 x (five
matmuls: the scores are recomputed), both times the visible fraction of a
causal mask; elementwise ops one per output element. Model FLOPs follow
`jlong.model.flops` (6 x parameters x tokens + causal attention, no
recompute); executed / model is the recompute factor, and MFU is model
FLOPs over the estimated time at the dense bf16 peak.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from jlong.errors import JlongError
from jlong.planner.hlo import Computation, HloModule, Instruction
from jlong.planner.memory import CompiledStep
from jlong.planner.targets import GPUS, GpuModel
from jlong.model.flops import model_flops_per_token

ESTIMATE_NOTE = ("an estimate read from the compiled program (a roofline over its kernels, collectives and host "
                 "copies in schedule order), not a measurement")


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Shares of the data-sheet rates a step reaches; `launch_us` per kernel."""

    gemm: float = 0.70
    attention_fwd: float = 0.60
    attention_bwd: float = 0.45
    hbm: float = 0.80
    links: float = 0.80  # NVLink, InfiniBand and PCIe, for every collective but all-to-all
    all_to_all: float = 0.70
    launch_us: float = 2.0

    def with_overrides(self, entries: list[str]) -> Efficiency:
        """`key=value` entries (`attention_fwd=0.55`) applied, each checked."""
        values = {}
        names = [f.name for f in dataclasses.fields(self)]
        for entry in entries:
            key, sep, text = entry.partition("=")
            if not sep or key not in names:
                raise JlongError(f"--efficiency {entry!r} must be KEY=VALUE with KEY one of {', '.join(names)}")
            try:
                value = float(text)
            except ValueError:
                raise JlongError(f"--efficiency {key} must be a number, got {text!r}") from None
            limit_ok = value >= 0 if key == "launch_us" else 0 < value <= 1
            if not limit_ok:
                bound = "non-negative" if key == "launch_us" else "in (0, 1]"
                raise JlongError(f"--efficiency {key} must be {bound}, got {text}")
            values[key] = value
        return dataclasses.replace(self, **values)

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name):g}" for f in dataclasses.fields(self))


@dataclasses.dataclass
class _Tally:
    """What one run of a computation costs; loops add their body's tally times their trip count."""

    time_s: float = 0.0
    flops: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # matmul, attention, other
    busy_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # kernel time by kind
    waited_s: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # exposed async work
    collective_bytes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (kind, link)
    host_bytes: float = 0.0
    hbm_bytes: float = 0.0
    launches: float = 0.0
    unknown_trip_loops: int = 0
    # Custom calls of a kind the planner cannot price (a Pallas or Triton kernel, say): target -> [calls, bytes].
    unpriced: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0.0, 0.0]))

    def add(self, other: _Tally, times: float = 1.0) -> None:
        self.time_s += other.time_s * times
        for mine, theirs in ((self.flops, other.flops), (self.busy_s, other.busy_s), (self.waited_s, other.waited_s),
                             (self.collective_bytes, other.collective_bytes)):
            for key, value in theirs.items():
                mine[key] += value * times
        self.host_bytes += other.host_bytes * times
        self.hbm_bytes += other.hbm_bytes * times
        self.launches += other.launches * times
        self.unknown_trip_loops += other.unknown_trip_loops
        for target, (calls, moved) in other.unpriced.items():
            self.unpriced[target][0] += calls * times
            self.unpriced[target][1] += moved * times


# Instructions that launch nothing: bookkeeping, aliases, and the waits of async pairs.
_NO_KERNEL = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "opt-barrier", "add-dependency",
    "partition-id", "replica-id", "domain",
}
_COLLECTIVES = {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all"}
_SLICING = {"dynamic-slice", "slice", "gather"}
_ELEMENTWISE_FREE = _NO_KERNEL | {"broadcast", "reshape", "transpose", "copy", "slice", "dynamic-slice",
                                  "dynamic-update-slice", "concatenate", "pad", "iota", "convert", "select",
                                  "gather", "scatter", "reverse", "fusion", "dot", "custom-call"}


class _Walker:
    """Walks a module's computations in schedule order and prices them."""

    def __init__(self, module: HloModule, gpu: GpuModel, efficiency: Efficiency, node_of: list[int]):
        self.module, self.gpu, self.eff, self.node_of = module, gpu, efficiency, node_of
        self._memo: dict[str, _Tally] = {}

    def run(self, name: str) -> _Tally:
        if name not in self._memo:
            self._memo[name] = self._timeline(self.module.computations[name])
        return self._memo[name]

    def _timeline(self, computation: Computation) -> _Tally:
        tally = _Tally()
        now = 0.0
        stream_free: dict[str, float] = collections.defaultdict(float)
        in_flight: dict[str, tuple[str, float]] = {}  # start name -> (stream, finish)
        for inst in computation.instructions:
            op = inst.opcode
            if op in _NO_KERNEL or _allocates_only(inst):
                continue
            if op.endswith("-done"):
                stream, finish = in_flight.pop(inst.operands[0], ("", now)) if inst.operands else ("", now)
                if finish > now:
                    tally.waited_s[stream] += finish - now
                    now = finish
                continue
            if op == "while":
                body, condition = (inst.attribute(key).lstrip("%") for key in ("body", "condition"))
                trips = inst.known_trip_count
                if trips is None:
                    trips = 1
                    tally.unknown_trip_loops += 1
                loop = _Tally()
                loop.add(self.run(body), trips)
                loop.add(self.run(condition), trips + 1)
                now += loop.time_s
                loop.time_s = 0.0
                tally.add(loop)
                continue
            if op in ("call", "conditional"):
                branches = [self.run(name) for name in inst.called]
                slowest = max(branches, key=lambda t: t.time_s)
                now += slowest.time_s
                inner = dataclasses.replace(slowest, time_s=0.0)
                tally.add(inner)
                continue
            kind, seconds = self._price(inst, computation, tally)
            launch = self.eff.launch_us * 1e-6
            tally.launches += 1
            tally.busy_s["launch"] += launch
            now += launch
            if op.endswith("-start") and kind in ("collective", "host"):  # runs beside the kernels until its done
                start = max(now, stream_free[kind])
                stream_free[kind] = start + seconds
                in_flight[inst.name] = (kind, start + seconds)
            else:
                now += seconds
        pending = max((finish for _, finish in in_flight.values()), default=now)
        if pending > now:
            for stream, finish in in_flight.values():
                tally.waited_s[stream] += max(finish - now, 0.0)
            now = pending
        tally.time_s = now
        return tally

    # -- one kernel

    def _price(self, inst: Instruction, computation: Computation, tally: _Tally) -> tuple[str, float]:
        """(stream kind, seconds) of one launched instruction; adds its counts to `tally`."""
        op = inst.opcode
        base = op.removesuffix("-start")
        if op == "async-start":
            base = self.module.computations[inst.called[0]].root.opcode
        if base in _COLLECTIVES:
            return "collective", self._collective(base, inst, computation, tally)
        moved = self._host_transfer_bytes(inst, computation)
        if moved:
            tally.host_bytes += moved
            seconds = moved / (self.gpu.pcie_bytes_per_s * self.eff.links)
            tally.busy_s["host copies"] += 0.0 if op.endswith("-start") else seconds
            return "host", seconds
        hbm = None
        if op == "custom-call":
            target = (inst.attribute("custom_call_target") or "").strip('"')
            if target.startswith("__cudnn$fmha"):
                return "compute", self._attention(inst, computation, target, tally)
            if "cublas" not in target:  # its FLOPs are unknown: counted at its memory traffic, and reported
                hbm = self._hbm_bytes(inst, computation)
                tally.unpriced[target][0] += 1
                tally.unpriced[target][1] += hbm
        flops, is_matmul = self._flops(inst, computation)
        hbm = self._hbm_bytes(inst, computation) if hbm is None else hbm
        tally.hbm_bytes += hbm
        tally.flops["matmul"] += flops.matmul
        tally.flops["other"] += flops.other
        rate = self.gpu.peak_bf16_flops * (self.eff.gemm if is_matmul else 1.0)
        seconds = max(flops.total / rate, hbm / (self.gpu.hbm_bytes_per_s * self.eff.hbm))
        tally.busy_s["matmul" if is_matmul else "other kernels"] += seconds
        return "compute", seconds

    def _attention(self, inst: Instruction, computation: Computation, target: str, tally: _Tally) -> float:
        config = inst.backend_config.get("cudnn_fmha_backend_config", {})
        B, H, Sq, Skv = (int(v) for v in config["intermediate_tensor_shape"]["dimensions"])
        head_dim = computation.operand_arrays(inst)[0].dims[-1]
        visible = _visible_fraction(config.get("mask_type", "NO_MASK"), Sq, Skv)
        backward = "Backward" in target
        flops = (10 if backward else 4) * B * H * Sq * Skv * head_dim * visible
        tally.flops["attention"] += flops
        hbm = sum(a.bytes for a in computation.operand_arrays(inst)) + inst.bytes
        tally.hbm_bytes += hbm
        efficiency = self.eff.attention_bwd if backward else self.eff.attention_fwd
        seconds = max(flops / (self.gpu.peak_bf16_flops * efficiency), hbm / (self.gpu.hbm_bytes_per_s * self.eff.hbm))
        tally.busy_s["attention backward" if backward else "attention forward"] += seconds
        return seconds

    def _collective(self, kind: str, inst: Instruction, computation: Computation, tally: _Tally) -> float:
        sent = sum(a.bytes for a in computation.operand_arrays(inst))
        if kind == "collective-permute":
            pairs = inst.source_target_pairs()
            crosses = any(self.node_of[s] != self.node_of[t] for s, t in pairs)
            wire = sent if pairs else 0
        else:
            groups = inst.device_groups(len(self.node_of))
            n = max(len(g) for g in groups)
            crosses = any(len({self.node_of[d] for d in g}) > 1 for g in groups)
            share = (n - 1) / n if n else 0.0
            wire = {"all-gather": sent * (n - 1), "all-reduce": 2 * sent * share}.get(kind, sent * share)
        link = "infiniband" if crosses else "nvlink"
        tally.collective_bytes[(kind, link)] += wire
        bandwidth = self.gpu.infiniband_bytes_per_s if crosses else self.gpu.nvlink_bytes_per_s
        efficiency = self.eff.all_to_all if kind == "all-to-all" else self.eff.links
        return wire / (bandwidth * efficiency)

    def _host_transfer_bytes(self, inst: Instruction, computation: Computation) -> int:
        """Bytes an instruction moves between host and device memory (0 if none)."""
        operands = computation.operand_arrays(inst)
        result = inst.arrays
        if inst.opcode.endswith("-start"):  # (operands..., results..., context): the results follow the operands
            result = inst.arrays[len(operands):]
        operands, result = _data(operands), _data(result)
        touches_host = any(a.on_host for a in (*operands, *result))
        if not touches_host or all(a.on_host for a in (*operands, *result)):
            return 0
        fused = self.module.computations[inst.called[0]] if inst.called else None
        root = fused.root if fused else inst
        if root.opcode == "dynamic-update-slice":
            return (fused.operand_arrays(root) if fused else operands)[1].bytes
        if fused and (root.opcode in _SLICING or root.opcode == "copy"):
            return root.bytes
        return sum(a.bytes for a in result if not a.on_host) or sum(a.bytes for a in operands if not a.on_host)

    def _flops(self, inst: Instruction, computation: Computation) -> tuple[_Flops, bool]:
        if inst.opcode == "custom-call" and "cublas" in (inst.attribute("custom_call_target") or ""):
            flops = _Flops(matmul=_cublas_flops(inst, computation))
            return flops, True
        if inst.opcode == "fusion":
            flops = self._fused_flops(inst.called[0])
            return flops, flops.matmul > 0
        if inst.opcode == "dot":
            return _Flops(matmul=_dot_flops(inst, computation)), True
        return _Flops(other=_elementwise_flops(inst)), False

    def _fused_flops(self, name: str) -> _Flops:
        total = _Flops()
        computation = self.module.computations[name]
        for inst in computation.instructions:
            if inst.opcode == "dot":
                total.matmul += _dot_flops(inst, computation)
            elif inst.opcode in ("reduce", "reduce-window"):  # one operation per input element
                total.other += sum(a.elements for a in computation.operand_arrays(inst)[: len(inst.operands) // 2])
            elif inst.opcode == "fusion":
                for called in inst.called:
                    inner = self._fused_flops(called)
                    total.matmul += inner.matmul
                    total.other += inner.other
            else:
                total.other += _elementwise_flops(inst)
        return total

    def _hbm_bytes(self, inst: Instruction, computation: Computation) -> int:
        """Bytes a kernel reads and writes: its operands and results, except
        that an operand only sliced is read as its slices, and a result
        updated in place (dynamic-update-slice) is written as its update."""
        operands = [computation.by_name[name] for name in inst.operands if name in computation.by_name]
        if inst.opcode != "fusion":
            if inst.opcode == "dynamic-update-slice":
                update = operands[1].bytes if len(operands) > 1 else 0
                return 2 * update
            return sum(o.bytes for o in operands) + inst.bytes
        fused = self.module.computations[inst.called[0]]
        read = 0
        for operand, parameter in zip(operands, fused.parameters):
            users = fused.users.get(parameter.name, [])
            if users and all(u.opcode in _SLICING and u.operands[0] == parameter.name for u in users):
                read += sum(u.bytes for u in users)
            elif users and all(u.opcode == "dynamic-update-slice" and u.operands[0] == parameter.name for u in users):
                continue  # updated in place: only the update is written
            else:
                read += operand.bytes
        written = 0
        roots = [fused.by_name[n] for n in fused.root.operands] if fused.root.opcode == "tuple" else [fused.root]
        for root in roots:
            if root.opcode == "dynamic-update-slice":
                written += fused.by_name[root.operands[1]].bytes if root.operands[1] in fused.by_name else 0
            else:
                written += root.bytes
        return read + written


@dataclasses.dataclass
class _Flops:
    matmul: float = 0.0
    other: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.other


def _allocates_only(inst: Instruction) -> bool:
    """XLA's buffer allocation for host offload: no kernel."""
    return inst.opcode == "custom-call" and "AllocateBuffer" in (inst.attribute("custom_call_target") or "")


def _data(arrays) -> list:
    """Arrays that hold data: not the scalars of indices and async contexts."""
    return [a for a in arrays if a.dims]


def _dot_flops(inst: Instruction, computation: Computation) -> float:
    lhs = computation.by_name[inst.operands[0]].arrays[0]
    contracted = math.prod(lhs.dims[d] for d in inst.int_list("lhs_contracting_dims"))
    return 2.0 * inst.arrays[0].elements * contracted


def _cublas_flops(inst: Instruction, computation: Computation) -> float:
    numbers = inst.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    lhs = computation.by_name[inst.operands[0]].arrays[0]
    contracted = math.prod(lhs.dims[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
    return 2.0 * inst.arrays[0].elements * contracted


def _elementwise_flops(inst: Instruction) -> float:
    if inst.opcode in _ELEMENTWISE_FREE or inst.opcode.endswith(("-start", "-done")):
        return 0.0
    return float(sum(a.elements for a in inst.arrays))


def _visible_fraction(mask_type: str, q_len: int, kv_len: int) -> float:
    """The share of the [Sq, Skv] scores a mask leaves: a causal mask keeps
    the lower triangle with its diagonal."""
    if "CAUSAL" in mask_type and q_len == kv_len:
        return (q_len + 1) / (2 * q_len)
    return 1.0


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
    efficiency: Efficiency

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s if self.step_time_s else 0.0

    @property
    def recompute_factor(self) -> float:
        return self.executed_flops / self.model_flops if self.model_flops else 0.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time_s * self.gpu.peak_bf16_flops) if self.step_time_s else 0.0

    def as_dict(self) -> dict:
        return {  # the keys of COST_KEYS, and the note
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_device": self.tokens_per_s / self.devices,
            "mfu": self.mfu,
            "executed_flops": self.executed_flops,
            "flops_by_kind": self.flops_by_kind,
            "model_flops": self.model_flops,
            "recompute_factor": self.recompute_factor,
            "time_by_kind": self.time_by_kind,
            "collective_bytes": self.collective_bytes,
            "collective_bytes_by_kind": self.collective_bytes_by_kind,
            "host_bytes": self.host_bytes,
            "hbm_bytes": self.hbm_bytes,
            "kernels": self.kernels,
            "unknown_trip_loops": self.unknown_trip_loops,
            "unpriced_custom_calls": self.unpriced_custom_calls,
            "cost_gpu": self.gpu.name,
            "efficiency": dataclasses.asdict(self.efficiency),
            "cost_note": ESTIMATE_NOTE,
        }


def cost_dict(cost: StepCost | None) -> dict:
    """The JSON keys of a step cost; None values and the reason when there is none."""
    if cost is None:
        return {**dict.fromkeys(COST_KEYS), "cost_note": CPU_NOTE}
    return cost.as_dict()


def estimate(module: HloModule, *, gpu: GpuModel, efficiency: Efficiency, node_of: list[int], tokens_per_step: int,
             model_flops_per_device: float) -> StepCost:
    """Prices a compiled program on `gpu`; `node_of[p]` is the node of the
    device that runs partition p."""
    tally = _Walker(module, gpu, efficiency, node_of).run(module.entry)
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
        efficiency=efficiency,
    )


CPU_NOTE = ("no step cost on the cpu target: it is read from the XLA:GPU program (plan with --target h100, "
            "which needs pip install 'jlong[gpu-plan]')")
COST_KEYS = ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "mfu", "executed_flops", "flops_by_kind",
             "model_flops", "recompute_factor", "time_by_kind", "collective_bytes", "collective_bytes_by_kind",
             "host_bytes", "hbm_bytes", "kernels", "unknown_trip_loops", "unpriced_custom_calls", "cost_gpu",
             "efficiency")


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
    model_flops = model_flops_per_token(config.model, config.train.seq_len) * tokens / len(devices)
    return estimate(step.hlo, gpu=gpu, efficiency=efficiency, node_of=node_of,
                    tokens_per_step=tokens, model_flops_per_device=model_flops)


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
    if cost.unknown_trip_loops:
        lines.append(f"  {cost.unknown_trip_loops} loops have a trip count the compiler cannot know; each is counted "
                     "once, so the time is a lower bound")
    gpu = cost.gpu
    lines.append(f"  assumes {gpu.name}: {gpu.peak_bf16_flops / 1e12:,.0f} TFLOP/s bf16 dense, HBM "
                 f"{gpu.hbm_bytes_per_s / 1e12:g} TB/s, NVLink {gpu.nvlink_bytes_per_s / 1e9:g} GB/s, InfiniBand "
                 f"{gpu.infiniband_bytes_per_s / 1e9:g} GB/s, PCIe {gpu.pcie_bytes_per_s / 1e9:g} GB/s per GPU and "
                 f"direction; efficiencies {cost.efficiency.describe()} (--efficiency KEY=VALUE changes them)")
    return "\n".join(lines)
