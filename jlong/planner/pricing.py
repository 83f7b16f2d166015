"""The price of one kernel, collective or host copy of a compiled program on
a GPU's data-sheet rates (the roofline `jlong.planner.step_cost` describes),
and the tally of what a stretch of the program executes."""

from __future__ import annotations

import collections
import dataclasses
import math

from jlong import kernel_runs
from jlong.attention.kernels import price_custom_call
from jlong.attention.step import CallCost
from jlong.errors import JlongError
from jlong.linear_attention import gated_delta, gated_delta_mosaic
from jlong.moe import grouped_matmul
from jlong.ops.pallas_calls import TRITON_FLOAT32_PRODUCT_COST, TRITON_IEEE_PRODUCT_COST, triton_kernel_name
from jlong.planner.hlo import Computation, HloModule, Instruction
from jlong.planner.targets import GpuModel


# jlong's GPU kernels, each with its FLOPs from its custom call and the kind of kernel it is priced as
# (the kind's efficiency in `Efficiency`).
KERNEL_PRICES = (*grouped_matmul.PRICED_CALLS, *gated_delta.PRICED_CALLS)
# Every GPU kernel jlong registers, by its name in a compiled program.
GPU_KERNEL_NAMES = frozenset(name for registry in (grouped_matmul, gated_delta)
                             for names in registry.GPU_KERNEL_NAMES.values() for name in names)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Shares of the data-sheet rates a step reaches; `launch_us` per kernel."""

    gemm: float = 0.70
    # measured: 230-240 TFLOP/s forward + backward, jlong's Triton grouped matmul at Qwen3-30B-A3B's 2048 -> 768
    # over 128 experts, 65,536 routed rows spread evenly and skewed, on an H200, jax 0.11.2, commit b6e22e7
    # (experiments/results/kernel-race.md; the H200's bf16 peak is the H100's). That race ran all three kernels
    # at 64 x 256, 8 warps, 4 stages; the tiles since (the products at 128 x 256) are not yet raced.
    grouped_matmul: float = 0.23
    # measured: the Triton gated delta rule's two recurrence kernels (32,768 tokens, 16 heads of 128) on an
    # H200, jax 0.11.2, commit b6e22e7 (experiments/results/kernel-race.md): 28.6 TFLOP/s forward, 68.5
    # backward, 45 together (94 GFLOP in 2.08 ms; a training step runs both). Latency, not the tensor cores,
    # bounds them: one chunk after another.
    gated_delta: float = 0.046
    # Not measured: the Triton gated delta rule's outputs kernel (o = qr S + a v_new) has never run on a GPU.
    # Priced at its measured sibling's rate: the grouped matmul's above, the other Triton kernel of tiled
    # products over independent programs. A race that runs it on a GPU measures its own.
    gated_delta_outputs: float = 0.23
    # Not measured: the Triton gated delta rule's chunk terms kernels (the terms and their gradient) have never
    # run on a GPU. Priced at their measured sibling's rate: the same rule's recurrence kernels above, the other
    # Triton kernels of small per-chunk products (16-row blocks, a triangular inverse, loops over the widths).
    gated_delta_chunk_terms: float = 0.046
    # a stated default, not yet measured: the Mosaic GPU grouped matmul has not been raced. The first Triton
    # kernel's measured rate at Qwen3-30B-A3B's expert shapes on an H100 (132-152 TFLOP/s, gpu-truth.md), as an
    # untuned kernel's.
    grouped_matmul_mosaic: float = 0.13
    # a stated default, not yet measured: the Mosaic GPU gated delta rule has not been raced. Half the Triton
    # rule's recurrence kernels' measured rate above, as a first port's (their 64 value columns a program give
    # a quarter of the Triton kernels' 16-column programs).
    gated_delta_mosaic: float = 0.023
    attention_fwd: float = 0.60
    attention_bwd: float = 0.53  # measured: 522 TFLOP/s, cuDNN 9.19 causal backward at 32K on an H100 SXM
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
                raise JlongError(f"efficiency {entry!r} must be KEY=VALUE with KEY one of {', '.join(names)}",
                                 "efficiency")
            try:
                value = float(text)
            except ValueError:
                raise JlongError(f"efficiency {key} must be a number, got {text!r}", "efficiency") from None
            limit_ok = value >= 0 if key == "launch_us" else 0 < value <= 1
            if not limit_ok:
                bound = "non-negative" if key == "launch_us" else "in (0, 1]"
                raise JlongError(f"efficiency {key} must be {bound}, got {text}", "efficiency")
            values[key] = value
        return dataclasses.replace(self, **values)

    def describe(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name):g}" for f in dataclasses.fields(self))

    def of_kind(self, kind: str) -> float:
        """The share of the bf16 peak a kernel of `kind` (as the planner sorts kernels) reaches; 1 for other
        kernels, bound by their memory traffic."""
        return {"matmul": self.gemm, "grouped matmul": self.grouped_matmul,
                "grouped matmul (mosaic)": self.grouped_matmul_mosaic, "gated delta": self.gated_delta,
                "gated delta outputs": self.gated_delta_outputs,
                "gated delta chunk terms": self.gated_delta_chunk_terms,
                "gated delta (mosaic)": self.gated_delta_mosaic}.get(kind, 1.0)


@dataclasses.dataclass
class Tally:
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
    # jlong's GPU kernels that have never run on a GPU: name -> [calls, the kind they are priced as].
    unmeasured: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(lambda: [0.0, ""]))

    def add(self, other: Tally, times: float = 1.0) -> None:
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
        for name, (calls, kind) in other.unmeasured.items():
            self.unmeasured[name][0] += calls * times
            self.unmeasured[name][1] = kind


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


class Pricer:
    """Prices one launched instruction of a module on `gpu`: its seconds, and
    its FLOPs, bytes and collective traffic added to a `Tally`; jlong's GPU
    kernels that `runs` does not count as run on a GPU are tallied by name."""

    def __init__(self, module: HloModule, gpu: GpuModel, efficiency: Efficiency, node_of: list[int],
                 runs: kernel_runs.KernelRuns | None = None):
        self.module, self.gpu, self.eff, self.node_of = module, gpu, efficiency, node_of
        self.runs = runs or kernel_runs.recorded()

    def price(self, inst: Instruction, computation: Computation, tally: Tally) -> tuple[str, float]:
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
            if (cost := kernel_call_cost(inst, computation)) is not None:
                return "compute", self._attention(inst, computation, cost, tally)
            if "cublas" not in target and _kernel_flops(inst, computation) is None:
                # its FLOPs are unknown: counted at its memory traffic, and reported
                hbm = self._hbm_bytes(inst, computation)
                tally.unpriced[target][0] += 1
                tally.unpriced[target][1] += hbm
        flops, kind = self._flops(inst, computation)
        hbm = self._hbm_bytes(inst, computation) if hbm is None else hbm
        tally.hbm_bytes += hbm
        tally.flops["matmul"] += flops.matmul
        tally.flops["other"] += flops.other
        rate = self.gpu.peak_bf16_flops * self.eff.of_kind(kind)
        if op == "custom-call":
            rate /= _product_cost(inst, computation, flops.matmul)
            name = gpu_kernel_name((inst.attribute("custom_call_target") or "").strip('"'), inst.attributes)
            if name is not None and not self.runs.ran([name]):
                tally.unmeasured[name][0] += 1
                tally.unmeasured[name][1] = kind
        seconds = max(flops.total / rate, hbm / (self.gpu.hbm_bytes_per_s * self.eff.hbm))
        tally.busy_s[kind] += seconds
        return "compute", seconds

    def _attention(self, inst: Instruction, computation: Computation, cost: CallCost, tally: Tally) -> float:
        """An attention kernel's call, at the FLOPs its kernel prices it at."""
        flops, backward = cost.flops, cost.backward
        tally.flops["attention"] += flops
        hbm = sum(a.bytes for a in computation.operand_arrays(inst)) + inst.bytes
        tally.hbm_bytes += hbm
        efficiency = self.eff.attention_bwd if backward else self.eff.attention_fwd
        seconds = max(flops / (self.gpu.peak_bf16_flops * efficiency), hbm / (self.gpu.hbm_bytes_per_s * self.eff.hbm))
        tally.busy_s["attention backward" if backward else "attention forward"] += seconds
        return seconds

    def _collective(self, kind: str, inst: Instruction, computation: Computation, tally: Tally) -> float:
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

    def _flops(self, inst: Instruction, computation: Computation) -> tuple[_Flops, str]:
        """Its FLOPs and the kind of kernel it is priced as: matmul, one of jlong's kernels
        (`KERNEL_PRICES`) or other kernels."""
        if inst.opcode == "custom-call" and "cublas" in (inst.attribute("custom_call_target") or ""):
            return _Flops(matmul=_cublas_flops(inst, computation)), "matmul"
        if inst.opcode == "custom-call" and (priced := _kernel_flops(inst, computation)) is not None:
            return _Flops(matmul=priced[0]), priced[1]
        if inst.opcode == "fusion":
            flops = self._fused_flops(inst.called[0])
            return flops, "matmul" if flops.matmul > 0 else "other kernels"
        if inst.opcode == "dot":
            return _Flops(matmul=_dot_flops(inst, computation)), "matmul"
        return _Flops(other=_elementwise_flops(inst)), "other kernels"

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
        updated in place (dynamic-update-slice) is written as its update.
        An asynchronous fusion (`fusion-start`) is counted as its fusion."""
        operands = [computation.by_name[name] for name in inst.operands if name in computation.by_name]
        if inst.opcode not in ("fusion", "fusion-start"):  # an async fusion (XLA:GPU runs some slicing ones so)
            if inst.opcode == "dynamic-update-slice":
                update = operands[1].bytes if len(operands) > 1 else 0
                return 2 * update
            return sum(o.bytes for o in operands) + inst.bytes
        fused = self.module.computations[inst.called[0]]
        read = 0
        for operand, parameter in zip(operands, fused.parameters):
            users = _through_bitcasts(fused, parameter.name)
            if users and all(u.opcode in _SLICING or u.opcode == "dynamic-update-slice" for u in users):
                # read as its slices; where it is updated in place, only the update is written
                read += sum(u.bytes for u in users if u.opcode in _SLICING)
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


def _through_bitcasts(fused: Computation, name: str) -> list[Instruction] | None:
    """The instructions that use value `name` of a fused computation as their
    operand 0, looking through bitcasts (a loop body slices its stacked
    input after reshaping it); None where any other use reads it."""
    found = []
    for user in fused.users.get(name, []):
        if user.operands[0] != name:
            return None
        if user.opcode == "bitcast":
            inner = _through_bitcasts(fused, user.name)
            if inner is None:
                return None
            found += inner
        else:
            found.append(user)
    return found


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


def kernel_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> tuple[float, str] | None:
    """(FLOPs, kind) of a call of one of jlong's own GPU kernels, from its
    custom-call target, attributes (as the HLO text prints them), operand
    and result shapes; None for any other call."""
    for call_flops, kind in KERNEL_PRICES:
        if (flops := call_flops(target, attributes, operand_dims, result_dims)) is not None:
            return flops, kind
    return None


def gpu_kernel_name(target: str, attributes: str) -> str | None:
    """The name of the jlong GPU kernel a custom call runs, from its target and attributes as the HLO text
    prints them (a Pallas Triton kernel's name, or a Mosaic GPU kernel's, which jax's lowering puts in the
    call's op_name); None for any other call."""
    if target == gated_delta_mosaic.MOSAIC_CALL:  # every Mosaic GPU kernel's call
        return next((name for name in GPU_KERNEL_NAMES if f"/{name}/" in (attributes or "")), None)
    name = triton_kernel_name(target, attributes)
    return name if name in GPU_KERNEL_NAMES else None


def gpu_kernels_in(module: HloModule) -> set[str]:
    """The names of the jlong GPU kernels a compiled program runs."""
    return {name for computation in module.computations.values() for inst in computation.instructions
            if inst.opcode == "custom-call" and (name := gpu_kernel_name(
                (inst.attribute("custom_call_target") or "").strip('"'), inst.attributes)) is not None}


def _kernel_flops(inst: Instruction, computation: Computation) -> tuple[float, str] | None:
    target = (inst.attribute("custom_call_target") or "").strip('"')
    return kernel_flops(target, inst.attributes, [a.dims for a in computation.operand_arrays(inst)],
                        inst.arrays[0].dims)


def _product_cost(inst: Instruction, computation: Computation, flops: float) -> float:
    """How much slower than bf16 products one of jlong's Pallas Triton kernels runs its product `flops`
    (those `KERNEL_PRICES` gives it; another call has none, so 1), on average: its operands' products at 1
    if they are 16-bit (some operand is: the tokens, the chunks' terms or an expert's rows), else at three
    TF32 products' cost (float32, `jlong.ops.triton_dots`); the products it takes in float32 whatever its
    operands' dtype (`gated_delta.FLOAT32_FLOPS`) at three TF32 products' or IEEE products' (scalar FMAs)
    cost."""
    target = (inst.attribute("custom_call_target") or "").strip('"')
    if triton_kernel_name(target, inst.attributes) is None or not flops:
        return 1.0
    operands = computation.operand_arrays(inst)
    sixteen_bit = any(a.dtype in ("bf16", "f16") for a in operands)
    dims = [a.dims for a in operands]
    ieee, tf32 = next((found for split in gated_delta.FLOAT32_FLOPS
                       if (found := split(target, inst.attributes, dims, inst.arrays[0].dims)) is not None), (0.0, 0.0))
    rest = (flops - ieee - tf32) * (1.0 if sixteen_bit else TRITON_FLOAT32_PRODUCT_COST)
    return (rest + ieee * TRITON_IEEE_PRODUCT_COST + tf32 * TRITON_FLOAT32_PRODUCT_COST) / flops


def _elementwise_flops(inst: Instruction) -> float:
    if inst.opcode in _ELEMENTWISE_FREE or inst.opcode.endswith(("-start", "-done")):
        return 0.0
    return float(sum(a.elements for a in inst.arrays))


def kernel_call_cost(inst: Instruction, computation: Computation) -> CallCost | None:
    """A custom call's cost as its attention kernel prices it (None: no kernel's call)."""
    if inst.opcode != "custom-call":
        return None
    target = (inst.attribute("custom_call_target") or "").strip('"')
    return price_custom_call(target, inst.backend_config, [a.dims for a in computation.operand_arrays(inst)])
