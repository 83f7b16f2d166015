"""The longest `train.seq_len` whose planned train step fits both budgets:
device memory per device and host memory per node.

Lengths are multiples of the mesh's granularity (sp times the tiles, which
must divide each device's shard). The search doubles from the configured
length until a plan does not fit, then bisects between the last length that
fits and the first that does not, to within one granule or 1%. The budget
that the first length over the limit exceeds is the one that binds.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from jlong.config import Config, config_to_dict, load_config, with_values
from jlong.errors import JlongError
from jlong.planner.memory import MemoryPlan, plan, state_bytes
from jlong.planner.memory_choice import choose, frugal
from jlong.planner.step_cost import Efficiency, StepCost
from jlong.planner.targets import GIB, PlanTarget

RELATIVE_RESOLUTION = 0.01


@dataclasses.dataclass(frozen=True)
class MaxLen:
    seq_len: int  # 0 when not even one granule fits
    plan: MemoryPlan | None  # the plan at seq_len
    probes: tuple[tuple[int, MemoryPlan], ...]  # every length tried, in order
    bound_by: str  # "device", "host" or "device and host": what the shortest length over the limit exceeds


def probe_line(seq_len: int, plan: MemoryPlan) -> str:
    """One planned length as `jlong maxlen` prints it: bytes per device and
    per node, and whether it fits or which budgets it is over."""
    return probe_head(seq_len) + probe_verdict(plan)


def probe_head(seq_len: int) -> str:
    """The start of a probe's line, printed while its program compiles."""
    return f"  seq_len {seq_len:>12,}: "


def probe_verdict(plan: MemoryPlan) -> str:
    """The rest of a probe's line, once its plan is made."""
    verdict = "fits" if plan.fits else "over the " + " and ".join(plan.exceeded) + " budget"
    return f"{plan.device_total / GIB:8.2f} GiB per device, {plan.host_per_node / GIB:8.1f} GiB host per node  {verdict}"


def with_seq_len(config: Config, seq_len: int) -> Config:
    return with_values(config, train={"seq_len": seq_len})


def longest_seq_len(
    config: Config,
    target: PlanTarget = PlanTarget(),
    *,
    on_start: Callable[[int], None] = lambda n: None,
    on_probe: Callable[[int, MemoryPlan], None] = lambda n, p: None,
) -> MaxLen:
    """Doubling, then bisection, over multiples of `config.sequence_granule`; plans
    compile for `target` (see `jlong.planner.memory.plan`). `on_start(seq_len)`
    is called as a length's compile starts, `on_probe(seq_len, plan)` once it is planned."""
    config = frugal(config)  # auto settings come down to their most frugal at the longest length
    step = config.sequence_granule
    probes: list[tuple[int, MemoryPlan]] = []

    def fits(granules: int) -> bool:
        seq_len = granules * step
        on_start(seq_len)
        result = plan(with_seq_len(config, seq_len), target)
        probes.append((seq_len, result))
        on_probe(seq_len, result)
        return result.fits

    first = max(config.train.seq_len // step, 1)
    _check_budget_covers_states(config, target)
    if fits(first):
        low, high = first, 2 * first
        while fits(high):
            low, high = high, 2 * high
    else:
        low, high = 0, first
        while low == 0 and high > 1:
            candidate = high // 2
            if fits(candidate):
                low = candidate
            else:
                high = candidate
    while high - low > 1 and (high - low) > RELATIVE_RESOLUTION * low:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    by_length = dict(probes)
    over = by_length[high * step]
    return MaxLen(seq_len=low * step, plan=by_length.get(low * step), probes=tuple(probes),
                  bound_by=" and ".join(over.exceeded))


def search_axes(entries: list[str]) -> list[tuple[str, list[str]]]:
    """`key=v1,v2,...` entries of `--search` -> (key, values) pairs."""
    axes = []
    for entry in entries:
        key, sep, values = entry.partition("=")
        choices = [v for v in values.split(",") if v]
        if not sep or not key or not choices:
            raise JlongError(f"search {entry!r} must look like section.key=value1,value2,...", "search")
        axes.append((key, choices))
    return axes


def settings(axes: list[tuple[str, list[str]]]) -> list[list[str]]:
    """Every combination of the axes' values, as lists of overrides."""
    return [[f"{key}={value}" for (key, _), value in zip(axes, combination)]
            for combination in itertools.product(*(values for _, values in axes))]


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """`config` with `key=value` overrides applied, validated again (itself
    without any). A ring degree given without an sp degree keeps the mesh's
    devices: sp becomes what the ring leaves (`mesh.ring=2` on 4 x 8 = 32
    devices: ring 2 x sp 16)."""
    if not overrides:
        return config
    given = dict(override.partition("=")[::2] for override in overrides)
    # Only well-formed degrees count here; a malformed one is load_config's to report.
    degrees = {key: int(value) for key, value in given.items() if key.startswith("mesh.") and value.isdigit()}
    if "mesh.ring" in degrees and "mesh.sp" not in given:
        mesh = config.mesh
        others = degrees.get("mesh.data", mesh.data) * degrees.get("mesh.fsdp", mesh.fsdp) * degrees["mesh.ring"]
        if others and mesh.size % others == 0:
            overrides = [*overrides, f"mesh.sp={mesh.size // others}"]
    return load_config(None, overrides, base=config_to_dict(config))


@dataclasses.dataclass(frozen=True)
class SettingLength:
    """One setting of a length search: the longest length it reaches, or why it reaches none."""

    setting: list[str]  # its overrides (none: the config as it is)
    config: Config | None  # the config with them (None when the overrides are refused)
    found: MaxLen | None
    refusal: JlongError | None  # an invalid setting, or states alone over the budget


def longest_by_setting(
    config: Config,
    target: PlanTarget,
    search: list[str] = (),
    *,
    on_setting: Callable[[list[str]], None] = lambda s: None,
    on_start: Callable[[int], None] = lambda n: None,
    on_probe: Callable[[int, MemoryPlan], None] = lambda n, p: None,
    on_refused: Callable[[list[str], JlongError], None] = lambda s, e: None,
) -> list[SettingLength]:
    """The longest length of every combination of the `key=v1,v2` entries of
    `search` (of the config alone without any). Without a search, a refusal
    is raised; with one, it is that setting's result."""
    results = []
    for setting in settings(search_axes(list(search))):
        on_setting(setting)
        candidate = None
        try:
            candidate = with_overrides(config, setting)
            found = longest_seq_len(candidate, target, on_start=on_start, on_probe=on_probe)
            results.append(SettingLength(setting, candidate, found, None))
        except JlongError as err:
            if not search:
                raise
            on_refused(setting, err)
            results.append(SettingLength(setting, candidate, None, err))
    return results


def best_length(results: list[SettingLength]) -> SettingLength | None:
    """The setting that reaches the longest length (the first of equals); None if every one was refused."""
    reached = [r for r in results if r.found is not None]
    return max(reached, key=lambda r: r.found.seq_len, default=None)


def fastest_setting(
    config: Config,
    target: PlanTarget,
    candidates: list[list[str]],
    efficiency: Efficiency = Efficiency(),
    *,
    on_start: Callable[[list[str]], None] = lambda s: None,
    on_probe: Callable[[list[str], MemoryPlan, StepCost], None] = lambda s, p, c: None,
    on_refused: Callable[[list[str], JlongError], None] = lambda s, e: None,
) -> tuple[list[str], MemoryPlan, StepCost] | None:
    """Each setting (a list of overrides) planned at the configured length;
    the one with the highest estimated tokens/s among those that fit both
    budgets (None if none fits). A setting the config refuses is skipped."""
    fitting = []
    for setting in candidates:
        on_start(setting)
        try:  # auto settings chosen for each setting
            chosen = choose(with_overrides(config, setting), target, efficiency=efficiency).chosen
        except JlongError as err:
            on_refused(setting, err)
            continue
        result, cost = chosen.plan, chosen.cost
        on_probe(setting, result, cost)
        if result.fits:
            fitting.append((setting, result, cost))
    return max(fitting, key=lambda found: found[2].tokens_per_s, default=None)


def _check_budget_covers_states(config: Config, target: PlanTarget) -> None:
    """A budget below what parameters, gradients and optimizer state need on
    each device fits no length: say so instead of searching."""
    budget_gib = target.device_budget_gib(config.train.gpu_memory_fraction)
    if not budget_gib > 0:
        raise JlongError(f"budget_gib must be positive, got {budget_gib:g}", "budget_gib")
    fixed = state_bytes(config, target)
    if fixed > budget_gib * GIB:
        if config.lora is not None:  # the adapters' state is small: the frozen base is what weighs
            offload = "set lora.base_dtype=nf4, " if config.lora.base_dtype == "compute" else ""
        else:
            offload = "" if config.memory.optimizer_offload else "set memory.optimizer_offload=true, "
        raise JlongError(
            f"budget_gib {budget_gib:g} is below the {fixed / GIB:.2f} GiB per device that parameters, "
            f"gradients and optimizer state need before any activation; {offload}raise the budget or spread "
            "the model over more devices (mesh.fsdp)", "budget_gib"
        )
