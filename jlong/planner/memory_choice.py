"""`memory.remat=auto` and `attention.heads_per_stage=auto`: what each layer
keeps and where, and UPipe's stage size, chosen to fill both budgets at the
configured length.

At long context attention is nearly all of a step's FLOPs, and the default
stack (`offload_inputs`) runs each layer's attention forward pass twice: once
forward, once again in the backward pass. A layer that keeps its attention
output and log-sum-exp (A bytes per device) skips the second, and every layer
saves the same time doing so. So the fastest choice within the budgets is the
one with the most such layers, their outputs on the device before host memory
(no PCIe copies). The search compiles few programs (each takes seconds to a
minute at long lengths):

1. The references: every layer under `offload_inputs`, at U = every head
   and U = the method's smallest when U is auto (larger stages are fewer,
   larger kernels and exchanges; smaller ones leave more room), compiled
   side by side. If none fits, one input per two layers
   (`memory.layers_per_checkpoint=2`) unless k was set.
2. From the reference's room on the device and in host memory, counted from
   the shapes: layers whose attention output goes to host memory with their
   input (`offload_attention`, first), then layers whose attention output
   stays on the device (`offload_inputs_save_attention`), the rest as the
   reference. When every layer's output fits on the device, so do their
   inputs, if there is room (`save_attention`: no host copies at all). The
   reference whose count gives the shortest estimated step wins (on the cpu
   target, with no estimate, the most layers, then the larger U).
3. That program is compiled; a plan over a budget (the counts miss some of
   XLA's buffers) takes its excess as a margin for the next try.

`memory.optimizer_offload` stays the user's: it lays the checkpoint out
differently, so a choice that changed between sessions would strand a run.
Settings given explicitly (U, k) are kept.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from jlong.attention.methods import method_of
from jlong.config import Config, with_values
from jlong.config.stages import StageRun
from jlong.families import family_of
from jlong.planner.memory import (
    CompiledStep,
    MemoryPlan,
    attention_output_bytes_per_layer,
    compile_train_step,
    describe_layers,
    layer_input_bytes_per_layer,
    plan_of,
)
from jlong.planner.step_cost import Efficiency, StepCost, step_cost
from jlong.planner.targets import GIB, PlanTarget

REFERENCE = "offload_inputs"
ON_DEVICE = "offload_inputs_save_attention"
TO_HOST = "offload_attention"
ALL_ON_DEVICE = "save_attention"
MAX_COMPILES = 6  # references and tries together; the search stops with the best that fitted


@dataclasses.dataclass(frozen=True)
class Planned:
    """One compiled candidate."""

    config: Config
    step: CompiledStep
    plan: MemoryPlan
    cost: StepCost | None

    @property
    def estimate(self) -> str:
        if self.cost is None:
            return ""
        return f"; est. {self.cost.step_time_s:,.1f} s a step"

    @property
    def footprint(self) -> str:
        return f"{_size(self.plan.device_total)} per device, {_size(self.plan.host_per_node)} host per node"


@dataclasses.dataclass(frozen=True)
class MemoryChoice:
    """The resolved config, its compiled program, and why."""

    chosen: Planned
    decisions: tuple[str, ...]  # one line per decision, with the figures it was based on
    compiles: int
    seconds: float
    references: tuple[Planned, ...] = ()  # the default stack at each candidate U, as compiled for the choice

    @property
    def config(self) -> Config:
        return self.chosen.config


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """How many layers keep their attention output, and where."""

    to_host: int  # offload_attention, the first layers
    on_device: int  # offload_inputs_save_attention, the next ones
    all_on_device: bool = False  # every layer, input included: save_attention

    @property
    def skipping(self) -> int:
        return self.to_host + self.on_device


def choose(config: Config, target: PlanTarget, devices=None, efficiency: Efficiency = Efficiency(), *,
           say=lambda line: None) -> MemoryChoice:
    """`config` with its auto settings chosen for `target`'s budgets (on
    `devices`, a running program's own, when given), the chosen program
    compiled. A config without auto settings is compiled as it is."""
    began, compiles, counting = time.perf_counter(), [0], threading.Lock()

    def planned(candidate: Config) -> Planned:
        step = compile_train_step(candidate, target, devices)
        with counting:
            compiles[0] += 1
        return Planned(candidate, step, plan_of(step), step_cost(step, efficiency))  # no cost on the cpu target

    def done(chosen: Planned, decisions: list[str], references=()) -> MemoryChoice:
        return MemoryChoice(chosen, tuple(decisions), compiles[0], time.perf_counter() - began, tuple(references))

    if not config.chooses_layout:
        return done(planned(config), [])
    decisions: list[str] = []

    def decide(line: str) -> None:
        decisions.append(line)
        say(line)

    references = _references(config, planned, decide)
    fitting = [reference for reference in references if reference.plan.fits]
    if config.memory.remat != "auto" or not fitting:
        return done(fitting[0] if fitting else references[-1], decisions, references)
    options = [(reference, _room(reference, decide)) for reference in fitting]
    reference, split = min(options, key=lambda option: _predicted(*option))
    chosen = _fill(reference, split, planned, decide, lambda: compiles[0] < MAX_COMPILES)
    speedup = ""
    if chosen.cost is not None and reference.cost is not None and chosen is not reference:
        speedup = f" ({reference.cost.step_time_s / chosen.cost.step_time_s:.3f}x its reference)"
    decide(f"chosen: {describe_remat(chosen.config)}: {chosen.footprint}{chosen.estimate}{speedup}")
    return done(chosen, decisions, references)


def _references(config: Config, planned, decide) -> list[Planned]:
    """The default stack (or the config's own remat when only U is auto) at
    every candidate stage size (when U is auto: all heads in one stage, and
    the method's smallest); grouped by two if none fits and k is free."""
    remat = REFERENCE if config.memory.remat == "auto" else config.memory.remat
    heads = config.model.num_attention_heads
    sizes = [None]
    if config.attention.heads_per_stage == "auto":
        workable = method_of(config).stage_sizes(config)
        sizes = sorted({workable[0], workable[-1]}, reverse=True)
    candidates = [with_values(config, memory={"remat": remat}, attention={} if size is None else
                              {"heads_per_stage": "all" if size == heads else size}) for size in sizes]
    with ThreadPoolExecutor(len(candidates)) as pool:  # XLA compiles them side by side, one core each
        references = list(pool.map(planned, candidates))
    for reference in references:
        decide(f"reference, every layer {remat}{_grouped(reference.config)}, heads_per_stage "
               f"{reference.config.heads_per_stage}: {_verdict(reference)}")
    if any(r.plan.fits for r in references) or config.memory.remat != "auto" or not _can_group_by_two(config):
        return references
    grouped = planned(with_values(references[-1].config, memory={"layers_per_checkpoint": 2}))
    decide(f"reference with memory.layers_per_checkpoint=2 (one input in host memory per two layers): "
           f"{_verdict(grouped)}")
    return [grouped]


def _verdict(candidate: Planned) -> str:
    plan = candidate.plan
    fits = "fits" if plan.fits else "over the " + " and ".join(plan.exceeded) + " budget"
    return f"{candidate.footprint}{candidate.estimate}, {fits}"


def _room(reference: Planned, decide) -> LayerSplit:
    """The most layers that can keep their attention output beside this reference, counted from the shapes."""
    config, plan = reference.config, reference.plan
    A, I = attention_output_bytes_per_layer(config), layer_input_bytes_per_layer(config)
    device_room = plan.budget - plan.device_total
    host_room = plan.host_budget_per_node - plan.host_per_node
    split = _split(config.model.num_hidden_layers, config.memory.layers_per_checkpoint, A, I,
                   plan.devices_per_node, device_room, host_room)
    per_layer_s = _attention_forward_s_per_layer(reference)
    saving = (f", each skipping an attention forward pass of est. {per_layer_s:,.3g} s: est. "
              f"{_predicted(reference, split)[0]:,.1f} s a step") if per_layer_s else ""
    decide(f"room beside the reference at heads_per_stage {config.heads_per_stage}: {_size(device_room)} per "
           f"device, {_size(host_room)} host per node; "
           f"a layer's attention output and log-sum-exp take {_size(A)} per device "
           f"({_size(A * plan.devices_per_node)} per node): {split.on_device} layer(s) keep it on the device, "
           f"{split.to_host} in host memory{saving}")
    return split


def _predicted(reference: Planned, split: LayerSplit) -> tuple:
    """What the search minimises: the estimated step time where there is one,
    else the fewest layers skipping attention's forward pass; then the larger stage."""
    per_layer_s = _attention_forward_s_per_layer(reference)
    U = reference.config.heads_per_stage
    if per_layer_s is None:
        return (-split.skipping, -U)
    return (reference.cost.step_time_s - split.skipping * per_layer_s, -U)


def _fill(reference: Planned, split: LayerSplit, planned, decide, may_compile) -> Planned:
    """The reference with `split`'s layers keeping their attention output,
    compiled; over a budget, what the count missed (the try's bytes beyond
    the reference and the outputs counted) replaces the margin and the split
    is counted again. The reference when nothing more fits."""
    config, plan = reference.config, reference.plan
    A, I = attention_output_bytes_per_layer(config), layer_input_bytes_per_layer(config)
    layers, k = config.model.num_hidden_layers, config.memory.layers_per_checkpoint
    device_room = plan.budget - plan.device_total
    host_room = plan.host_budget_per_node - plan.host_per_node
    overhead = _margin(A)
    while split.skipping and may_compile():
        candidate = planned(_with_split(config, split))
        decide(f"try {describe_remat(candidate.config)}: {_verdict(candidate)}")
        if candidate.plan.fits:
            return candidate
        tried = candidate.plan
        missed = tried.device_total - plan.device_total - split.on_device * A
        overhead = max(missed, overhead + max(tried.device_total - tried.budget, 0))
        host_room -= max(tried.host_per_node - tried.host_budget_per_node, 0)
        following = _split(layers, k, A, I, plan.devices_per_node, device_room, host_room, overhead)
        if following == split:  # counted the same again: it would plan the same
            break
        split = following
    decide("every layer recomputes its attention: no try with attention outputs kept fitted beside the reference")
    return reference


def _split(layers: int, k: int, A: int, I: int, per_node: int, device_room: int, host_room: int,
           overhead: int | None = None) -> LayerSplit:
    """The most layers that keep their attention output within the rooms
    (per device, per node), on the device first; the rest keep one input per
    k layers in host memory, so they must stay a positive multiple of k
    unless every layer keeps its output (then k must be 1). Runs of layers
    under other policies cost `overhead` device bytes besides (`_margin`)."""
    overhead = _margin(A) if overhead is None else overhead
    host_per_layer_to_host = (A + I - I // k) * per_node  # its own input too, no longer in a group of k
    host_per_layer_on_device = (I - I // k) * per_node
    if k == 1 and layers * A <= device_room:
        both = layers * (A + I) <= device_room  # the inputs come back from host memory too
        return LayerSplit(0, layers, all_on_device=both)
    best = LayerSplit(0, 0)
    for on_device in range(layers + 1):
        if on_device * A + overhead > device_room:
            break
        left = host_room - on_device * host_per_layer_on_device
        to_host = min(max(left // host_per_layer_to_host, 0), layers - on_device)
        while to_host >= 0 and not _workable_rest(layers - on_device - to_host, k):
            to_host -= 1
        if to_host < 0:
            continue
        candidate = LayerSplit(int(to_host), on_device)
        if (candidate.skipping, candidate.on_device) > (best.skipping, best.on_device):
            best = candidate
    return best


def _margin(A: int) -> int:
    """Device bytes beyond the outputs themselves when layers run in several scans (parameter slices, the
    joined gradient): a quarter of one layer's output, a figure from Llama3-8B at 5M on h100 (0.9 GiB).
    A try over the budget adds what it missed by."""
    return A // 4


def _workable_rest(rest: int, k: int) -> bool:
    return (rest == 0 and k == 1) or (rest > 0 and rest % k == 0)


def _with_split(config: Config, split: LayerSplit) -> Config:
    layers = config.model.num_hidden_layers
    if split.skipping == layers and split.to_host == 0:
        return with_values(config, memory={"remat": ALL_ON_DEVICE if split.all_on_device else ON_DEVICE})
    if split.skipping == layers:
        runs = {TO_HOST: split.to_host}
        return with_values(config, memory={"remat": ON_DEVICE, "remat_runs": runs}) if split.on_device else \
            with_values(config, memory={"remat": TO_HOST})
    runs = {name: count for name, count in ((TO_HOST, split.to_host), (ON_DEVICE, split.on_device)) if count}
    return with_values(config, memory={"remat": REFERENCE, "remat_runs": runs})


def choice_dict(choice: MemoryChoice) -> dict:
    """The JSON keys of a choice (`jlong plan --json`): the settings chosen and why; none without auto settings."""
    if not choice.decisions:
        return {}
    memory = choice.config.memory
    return {"memory_choice": {
        "remat": memory.remat, "remat_runs": dict(memory.remat_runs),
        "layers_per_checkpoint": memory.layers_per_checkpoint, "heads_per_stage": choice.config.heads_per_stage,
        "decisions": list(choice.decisions), "compiles": choice.compiles, "seconds": round(choice.seconds, 1),
    }}


def resolve_stages(stages: list[StageRun], target: PlanTarget, devices=None, *, say=lambda line: None,
                   ) -> list[StageRun]:
    """Every stage with its auto settings chosen (`choose`, which says each decision); a stage without any is
    compiled as it is."""
    resolved = []
    for stage in stages:
        if len(stages) > 1 and stage.config.chooses_layout:
            say(f"stage {stage.number}: choosing memory settings at seq_len {stage.config.train.seq_len:,}")
        resolved.append(dataclasses.replace(stage, config=choose(stage.config, target, devices, say=say).config))
    return resolved


def frugal(config: Config) -> Config:
    """`config` with its auto settings at their most frugal (every layer `offload_inputs`, one input per two
    layers where k is free, the method's default stage size): the settings that reach the longest length,
    which the choice comes down to there; for searches over lengths."""
    if not config.chooses_layout:
        return config
    memory = {}
    if config.memory.remat == "auto":
        memory["remat"] = REFERENCE
        if _can_group_by_two(config):
            memory["layers_per_checkpoint"] = 2
    heads = config.attention.heads_per_stage
    if heads == "auto":
        heads = method_of(config).stage_sizes(config)[-1]
    return with_values(config, memory=memory, attention={"heads_per_stage": heads})


def _can_group_by_two(config: Config) -> bool:
    """Whether k is free and 2 divides every run of layers the model scans (`Family.scanned_runs`)."""
    model = config.model
    return config.memory.layers_per_checkpoint == 1 and all(run % 2 == 0 for run in
                                                            family_of(model).scanned_runs(model))


def _attention_forward_s_per_layer(reference: Planned) -> float | None:
    """The reference runs each layer's attention forward pass twice; the estimated time of one."""
    if reference.cost is None:
        return None
    total = reference.cost.time_by_kind.get("attention forward", 0.0)
    return total / (2 * reference.config.model.num_hidden_layers) or None


def _size(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.2f} MiB"


def _grouped(config: Config) -> str:
    k = config.memory.layers_per_checkpoint
    return f" (one input per {k} layers)" if k > 1 else ""


def describe_remat(config: Config) -> str:
    """'offload_attention for layers 0-5, ..., heads_per_stage 16'."""
    return f"{describe_layers(config)}, heads_per_stage {config.heads_per_stage}"
