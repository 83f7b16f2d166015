"""`jlong train --dry-run`: everything a launch checks before its first step
(devices, mesh, data, checkpoints, outputs, the compiled step's memory),
printed, with no step run and nothing written."""

from __future__ import annotations

from pathlib import Path

import jax

from jlong.config import Config
from jlong.config.stages import stage_runs
from jlong.data.documents import PackedDocuments, describe as describe_documents
from jlong.data.sources import Batches, TokenFile
from jlong.planner.memory import format_plan, plan
from jlong.planner.targets import GIB, PlanTarget
from jlong.training.checkpoint_owner import check_owner
from jlong.training.initial_weights import check_init_from
from jlong.training.loop import checked_last_step
from jlong.training.metric_sinks import check_available
from jlong.training.report import LOSS_PLOT
from jlong.training.run_dir import RunDir


def describe(config: Config, until_step: int | None) -> str:
    """What `jlong train` would do with `config` on the devices this process sees."""
    last = checked_last_step(config, until_step)  # the checks of a real run, first
    check_available(config.train.log_to)
    batches = Batches(config)
    if config.run_dir:
        RunDir(config)
    done = check_owner(config).newest if config.checkpoint.dir else 0
    initial = None if done else check_init_from(config)
    devices = jax.devices()
    mesh, train = config.mesh, config.train
    lines = [
        f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}) in "
        f"{jax.process_count()} process(es)",
        f"mesh: data {mesh.data} x fsdp {mesh.fsdp} x ring {mesh.ring} x sp {mesh.sp}; "
        f"{config.shard_tokens:,} tokens of each sequence per device, attention heads in stages of "
        f"{config.heads_per_stage}",
        f"data: {_data(config, batches)}",
        f"steps: {done + 1}-{last} of train.steps={train.steps}, {train.batch_size} x {train.seq_len:,} tokens each"
        if done < last else f"steps: none left (checkpointed at step {done} of {last})",
        f"outputs: {_outputs(config, done)}",
    ]
    if initial:
        lines.append(f"starting weights: {initial.describe()}, with a fresh optimizer (train.init_from)")
    stats = devices[0].memory_stats() or {}
    capacity = stats.get("bytes_limit")
    target = PlanTarget(budget_gib=capacity / GIB if capacity else None)
    stages = stage_runs(config)
    for stage in stages:
        if len(stages) > 1:
            Batches(stage.config)  # each stage's data, checked
            lines.append(f"stage {stage.number} of {len(stages)}: steps {stage.first}-{stage.last} at seq_len "
                         f"{stage.config.train.seq_len:,}")
        lines.append(format_plan(plan(stage.config, target, devices=devices), stage.config))
    return "\n".join(lines)


def _data(config: Config, batches: Batches) -> str:
    if isinstance(batches.source, PackedDocuments):
        return describe_documents(batches.source, config.data.path)
    if isinstance(batches.source, TokenFile):
        source = batches.source
        tokens = len(source.tokens)
        steps_per_pass = source.num_samples / config.train.batch_size
        order = "shuffled" if config.data.shuffle else "in order"
        packed = f", documents split at id {config.data.eos_id}" if config.data.eos_id is not None else ""
        return (f"{config.data.path}: {tokens:,} tokens, {source.num_samples:,} sequences ({order}{packed}); "
                f"one pass is {steps_per_pass:,.1f} steps")
    return "synthetic (learnable random sequences; set data.source=tokens and data.path for real data)"


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
