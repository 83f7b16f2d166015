"""jlong from Python: what experiment scripts and notebooks call.

    import jax, jlong

    result = jlong.plan("configs/llama3-8b-5m.yaml", ["train.seq_len=131072"], target="h100")
    result.fits, result.device_bytes, result.host_bytes_per_node, result.step_time_s

Every function takes a `Config` (`jlong.load_config`) or a path to a YAML
file with `key.path=value` overrides, and calls the library the command
line calls; nothing here runs the command line. Bad input raises
`jlong.JlongError` with the command line's one-line message. jax may be
imported first: these functions start its backends as they need (virtual
CPU devices for the mesh, the CPU and the CUDA plugin's compiler for GPU
targets), and where jax has started already in a way a call cannot use,
the error says what to do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import jlong.components  # noqa: F401  (the families and methods a config names register themselves)
from jlong.config import Config, config_to_dict, load_config
from jlong.errors import JlongError
from jlong.jax_startup import start_backends
from jlong.planner.maxlen import SettingLength, longest_by_setting
from jlong.planner.memory import MemoryPlan
from jlong.planner.memory_choice import choose
from jlong.planner.step_cost import Efficiency, StepCost
from jlong.planner.targets import DEFAULT_HOST_BUDGET_GIB, PlanTarget, node_shape, resolve_target, start_planning_backend

ConfigLike = Config | str | Path


def config_of(config: ConfigLike, overrides: Sequence[str] = (), *, check_stages: bool = True) -> Config:
    """`config` itself, or the YAML file it names, with the overrides applied."""
    if isinstance(config, Config):
        if not overrides:
            return config
        return load_config(None, list(overrides), base=config_to_dict(config), check_stages=check_stages)
    if not isinstance(config, (str, Path)):
        raise JlongError(f"a config is a jlong.Config or the path of a YAML file, got {type(config).__name__}")
    return load_config(config, list(overrides), check_stages=check_stages)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A planned train step: what `jlong plan --json` reports, as attributes."""

    config: Config
    target: str
    memory: MemoryPlan  # every byte count (per device; host also per node)
    cost: StepCost | None  # read from the compiled XLA:GPU program; None on the cpu target
    # memory.remat=auto / attention.heads_per_stage=auto: how the planner chose `config`'s settings, a line each
    decisions: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Within both budgets: the device's and the node's host memory."""
        return self.memory.fits

    @property
    def device_bytes(self) -> int:
        """Per device, cuDNN's workspace included (`device_total`)."""
        return self.memory.device_total

    @property
    def host_bytes_per_node(self) -> int:
        return self.memory.host_per_node

    @property
    def step_time_s(self) -> float | None:
        """An estimate read from the compiled program (never a measurement); None on the cpu target."""
        return self.cost.step_time_s if self.cost else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.cost.tokens_per_s if self.cost else None

    def as_dict(self) -> dict:
        """The object `jlong plan --json` prints."""
        from jlong.planner.step_cost import cost_dict

        keys = {**self.memory.as_dict(), "program": "train", **cost_dict(self.cost)}
        if self.decisions:
            keys["memory_choice_decisions"] = list(self.decisions)
        return keys


def planning_target(config: Config, target: str | None = None, *, budget_gib: float | None = None,
                    host_budget_gib: float = DEFAULT_HOST_BUDGET_GIB, gpus_per_node: int = 8) -> PlanTarget:
    """The target and budgets, checked, with jax started for planning (the
    CPU, and the CUDA plugin's compiler for GPU targets). `target` None:
    h100 where the plugin is installed, cpu elsewhere (as `jlong plan`)."""
    if budget_gib is not None and not budget_gib > 0:
        raise JlongError(f"the device budget must be positive, got {budget_gib:g} GiB")
    if not host_budget_gib > 0:
        raise JlongError(f"the host budget must be positive, got {host_budget_gib:g} GiB")
    chosen = PlanTarget(resolve_target(target), budget_gib, host_budget_gib, gpus_per_node)
    node_shape(config.mesh.size, chosen.gpus_per_node)  # whole nodes, before anything compiles
    start_planning_backend(cpu_devices=1 if chosen.is_gpu else config.mesh.size)
    return chosen


def plan(config: ConfigLike, overrides: Sequence[str] = (), target: str | None = None, *,
         budget_gib: float | None = None, host_budget_gib: float = DEFAULT_HOST_BUDGET_GIB, gpus_per_node: int = 8,
         efficiency: Efficiency | None = None) -> Plan:
    """Compiles the configured train step ahead of time for `target` (h100,
    h200, b200: XLA:GPU, deviceless; cpu: virtual CPU devices) and reports its
    memory against the budgets and, on GPU targets, its estimated cost. Auto
    settings (memory.remat, attention.heads_per_stage) are chosen first: the
    plan's config is the resolved one."""
    resolved = config_of(config, overrides)
    chosen = planning_target(resolved, target, budget_gib=budget_gib, host_budget_gib=host_budget_gib,
                             gpus_per_node=gpus_per_node)
    choice = choose(resolved, chosen, efficiency=efficiency or Efficiency())
    return Plan(choice.config, chosen.name, choice.chosen.plan, choice.chosen.cost, choice.decisions)


def maxlen(config: ConfigLike, overrides: Sequence[str] = (), target: str | None = None, *,
           search: Sequence[str] = (), budget_gib: float | None = None,
           host_budget_gib: float = DEFAULT_HOST_BUDGET_GIB, gpus_per_node: int = 8,
           on_probe: Callable[[int, MemoryPlan], None] = lambda seq_len, plan: None) -> list[SettingLength]:
    """The longest train.seq_len that fits both budgets (`jlong maxlen`), for
    the config as it is or for every combination of `search` entries
    (`"memory.layers_per_checkpoint=1,2"`): one result per setting, in order;
    `jlong.planner.maxlen.best_length` picks the longest. `on_probe(seq_len,
    plan)` hears of each planned length as the search goes (a search on a GPU
    target compiles minutes per length)."""
    resolved = config_of(config, overrides)
    chosen = planning_target(resolved, target, budget_gib=budget_gib, host_budget_gib=host_budget_gib,
                             gpus_per_node=gpus_per_node)
    return longest_by_setting(resolved, chosen, list(search), on_probe=on_probe)


def train(config: ConfigLike, overrides: Sequence[str] = (), *, until_step: int | None = None) -> list[dict]:
    """Trains in this process as `jlong train` does (resuming from the run's
    checkpoints; SIGTERM or Ctrl-C stops after the step with a checkpoint);
    returns this session's metric records."""
    resolved = config_of(config, overrides)
    start_backends(cpu_devices=resolved.mesh.size)
    from jlong.training.loop import train as train_loop

    return train_loop(resolved, until_step=until_step)


def generate(config: ConfigLike, overrides: Sequence[str] = (), *, prompts: str | Path, out: str | Path | None = None,
             checkpoint: str | Path | None = None, tokenizer: str | Path | None = None, max_new_tokens: int = 256,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, num_samples: int = 1, seed: int = 0,
             stop_ids: Sequence[int] = ()) -> list[dict]:
    """`jlong generate`: one record per prompt of the `prompts` file and sample, in prompt order then sample
    order (`completion_ids`, `logprobs`, `finish_reason`, ...), also written to `out` when given."""
    from jlong.completions import GenerateRequest, checked_request, generate as run

    request = GenerateRequest(
        prompts=str(prompts), out=None if out is None else str(out), checkpoint=None if checkpoint is None else str(
            checkpoint), tokenizer=None if tokenizer is None else str(tokenizer), max_new_tokens=max_new_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, num_samples=num_samples, seed=seed,
        stop_ids=tuple(stop_ids))
    checked = checked_request(config_of(config, overrides, check_stages=False), request)
    start_backends(cpu_devices=checked.config.mesh.size)
    return run(checked, request, progress=False)


def evaluate(config: ConfigLike, checkpoint: str | Path, overrides: Sequence[str] = ()) -> dict:
    """`jlong eval`: the loss by position on eval.path (or eval.mix) and passkey retrieval
    of a checkpoint (a jlong checkpoint directory or a Hugging Face one), on
    the config's mesh; the dict `eval.json` holds."""
    from jlong.eval.evaluate import at_checkpoint, eval_inputs, evaluate as evaluate_checkpoint
    from jlong.parallel.placement import make_mesh

    resolved = at_checkpoint(config_of(config, overrides, check_stages=False), str(checkpoint), list(overrides))
    inputs = eval_inputs(resolved)
    start_backends(cpu_devices=resolved.mesh.size)
    return evaluate_checkpoint(resolved, str(checkpoint), make_mesh(resolved.mesh), inputs)
