"""`jlong train --dry-run`: everything a launch checks before its first step
(devices, mesh, data, checkpoints, outputs, the compiled step's memory),
printed, with no step run and nothing written."""

from __future__ import annotations

from pathlib import Path

import jax

from jlong.attention.kernels import describe as describe_kernel
from jlong.config import Config
from jlong.config.stages import StageRun, stage_runs
from jlong.data.documents import PackedDocuments, describe as describe_documents
from jlong.data.pairs import PreferencePairs, describe as describe_pairs
from jlong.data.mixture import Mixture
from jlong.data.recorded import with_recorded_data
from jlong.data.sources import Batches, TokenFile
from jlong.model.transformer import ForwardOptions
from jlong.ops.shards import OneDevice
from jlong.planner.memory import format_plan, plan_of
from jlong.planner.memory_choice import choose, frugal
from jlong.planner.targets import PlanTarget
from jlong.training.checkpoint_owner import check_lora_base_of, check_owner
from jlong.init_from import check_init_from
from jlong.training.loop import checked_last_step, run_target
from jlong.training.metric_sinks import check_available
from jlong.training.report import LOSS_PLOT, realised_mix
from jlong.training.run_dir import RunDir


def describe(config: Config, until_step: int | None) -> str:
    """What `jlong train` would do with `config` on the devices this process sees."""
    config = with_recorded_data(config)
    last = checked_last_step(config, until_step)  # the checks of a real run, first
    check_available(config.train.log_to)
    batches = Batches.from_config(config)
    if config.run_dir:
        RunDir(config)
    done = check_owner(config).newest if config.checkpoint.dir else 0
    notes = []
    check_lora_base_of(config, done, notes.append)
    initial = None if done else check_init_from(config)
    devices = jax.devices()
    mesh, train = config.mesh, config.train
    stages = ("stages the planner chooses (below)" if config.attention.heads_per_stage == "auto"
              else f"stages of {config.heads_per_stage} heads")
    lines = [
        f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}) in "
        f"{jax.process_count()} process(es)",
        f"mesh: data {mesh.data} x fsdp {mesh.fsdp} x ring {mesh.ring} x sp {mesh.sp}; "
        f"{config.shard_tokens:,} tokens of each sequence per device",
        f"attention: {config.attention.sp_method} in {stages}, kernel "
        f"{describe_kernel(ForwardOptions.for_training(frugal(config), OneDevice(), devices[0].platform).attention)}",
        f"data: {_data(config, batches, range(done + 1, max(last, done + 1) + 1))}"
        + ("; the loss counts only the ids the token files' masks mark (data.loss_mask)" if config.data.loss_mask
           else ""),
        f"steps: {done + 1}-{last} of train.steps={train.steps}, {train.batch_size} x {train.seq_len:,} tokens each"
        if done < last else f"steps: none left (checkpointed at step {done} of {last})",
        f"outputs: {_outputs(config, done)}",
    ]
    if initial:
        lines.append(f"starting weights: {initial.describe()}, with a fresh optimizer (train.init_from)")
    lines += notes
    lines += stage_plans(stage_runs(config), run_target(devices), devices)
    return "\n".join(lines)


def stage_plans(stages: list[StageRun], target: PlanTarget, devices) -> list[str]:
    """Each stage's memory plan on `devices` and, on a GPU the planner knows,
    its estimated step time and the whole recipe's (estimates, never measurements)."""
    lines, recipe_s = [], 0.0
    for stage in stages:
        if len(stages) > 1:
            Batches.from_config(stage.config)  # each stage's data, checked
            lines.append(f"stage {stage.number} of {len(stages)}: steps {stage.first}-{stage.last} at seq_len "
                         f"{stage.config.train.seq_len:,}")
        choice = choose(stage.config, target, devices)
        lines += [f"memory choice: {line}" for line in choice.decisions]
        config, step, cost = choice.config, choice.chosen.step, choice.chosen.cost
        lines.append(format_plan(plan_of(step), config))
        if cost is not None:
            recipe_s += cost.step_time_s * (stage.last - stage.first + 1)
            lines.append(f"estimated step time {cost.step_time_s:,.1f} s ({cost.tokens_per_s:,.0f} tokens/s), read "
                         "from the compiled program: an estimate, not a measurement")
    if recipe_s and len(stages) > 1:
        lines.append(f"the whole recipe: estimated {recipe_s / 3600:,.1f} h")
    return lines


def _data(config: Config, batches: Batches, steps: range) -> str:
    if isinstance(batches.source, Mixture):
        mixture = batches.source
        parts = [f"{source.name}: {_rows(config, source.sampler, source.name)}, weight {source.weight:g}"
                 for source in mixture.sources]
        drawn = realised_mix([mixture.tokens_by_source(step) for step in steps])
        return (f"a mixture of {len(parts)} sources ({'; '.join(parts)}); steps {steps.start}-{steps.stop - 1} "
                f"draw {drawn}")
    if isinstance(batches.source, (PackedDocuments, TokenFile, PreferencePairs)):
        return _rows(config, batches.source, config.data.path)
    return "synthetic (learnable random sequences; set data.source=tokens and data.path for real data)"


def _rows(config: Config, source, named) -> str:
    """One token corpus: its documents, its preference pairs, or its windows."""
    if isinstance(source, PackedDocuments):
        return describe_documents(source, named)
    if isinstance(source, PreferencePairs):
        return describe_pairs(source, named)
    steps_per_pass = source.num_samples / config.train.batch_size
    order = "shuffled" if source.shuffle else "in order"
    packed = f", documents split at id {config.data.eos_id}" if config.data.eos_id is not None else ""
    return (f"{named}: {len(source.tokens):,} tokens, {source.num_samples:,} sequences ({order}{packed}); "
            f"one pass is {steps_per_pass:,.1f} steps")


def _outputs(config: Config, done: int) -> str:
    parts = []
    if config.run_dir:
        run_dir = Path(config.run_dir)
        parts.append(f"metrics {run_dir / 'metrics.jsonl'}, config {run_dir / 'config.yaml'}, "
                     f"loss curve {run_dir / LOSS_PLOT}")
    else:
        parts.append("no run_dir: metrics are not kept")
    checkpoint = config.checkpoint
    if checkpoint.dir:
        cadence = f"every {checkpoint.every} steps and at the end" if checkpoint.every else "at the end"
        resume = f"; resumes from step {done}" if done else ""
        parts.append(f"checkpoints in {checkpoint.dir} {cadence}, keeping {checkpoint.keep}{resume}")
    else:
        parts.append("no checkpoint.dir: nothing to resume from")
    return "; ".join(parts)
