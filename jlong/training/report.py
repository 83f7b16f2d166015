"""What a run says when it ends: where its outputs went, how the loss moved,
how fast it ran, and a loss curve (PNG) in the run directory; and what a
run that has nothing left to do says instead of training."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from jlong.config import Config
from jlong.plots import pyplot, save

LOSS_PLOT = "loss.png"


def summary(config: Config, records: list[dict], seconds: float, checkpoint_step: int | None) -> str:
    """Lines for the end of a run that trained `records` (this session's steps)."""
    first, last = records[0], records[-1]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in records)
    lines = [
        f"trained steps {first['step']}-{last['step']} of {config.train.steps} in {seconds:,.0f} s "
        f"(median {tokens_per_s:,.0f} tokens/s)",
        f"  loss         {first['loss']:.4f} at step {first['step']} -> {last['loss']:.4f} at step {last['step']}",
    ]
    if "reward" in first:  # GRPO: its objective's own measure (the loss sits near zero, advantages being zero-mean)
        lines.insert(1, f"  reward       {first['reward']:.4f} at step {first['step']} -> {last['reward']:.4f} at "
                        f"step {last['step']} (each step's rollouts)")
    if config.data.loss_mask:  # every metrics line has trained_tokens; the summary names them where masks count
        trained = sum(r["trained_tokens"] for r in records)
        lines.append(f"  trained      {trained:,} target tokens (the ones the token files' masks mark)")
    mixed = [r["tokens_by_source"] for r in records if "tokens_by_source" in r]
    if mixed:
        lines.append(f"  data mix     {realised_mix(mixed)}")
    evaluated = [r for r in records if "eval_loss" in r]
    if evaluated:
        lines.append(f"  eval loss    {evaluated[0]['eval_loss']:.4f} at step {evaluated[0]['step']} -> "
                     f"{evaluated[-1]['eval_loss']:.4f} at step {evaluated[-1]['step']} (held-out)")
        by_source = evaluated[-1].get("eval_loss_by_source")
        if by_source:
            lines.append("  by source    " + ", ".join(f"{name} {loss:.4f}" for name, loss in by_source.items()))
    if config.run_dir:
        run_dir = Path(config.run_dir)
        lines += [f"  metrics      {run_dir / 'metrics.jsonl'}", f"  loss curve   {run_dir / LOSS_PLOT}",
                  f"  config       {run_dir / 'config.yaml'}"]
    else:
        lines.append("  metrics      not kept (set run_dir to keep metrics, the config and a loss curve)")
    if config.checkpoint.dir:
        lines.append(f"  checkpoints  {config.checkpoint.dir} (newest: step {checkpoint_step})")
    else:
        lines.append("  checkpoints  none (set checkpoint.dir to keep them and resume)")
    return "\n".join(lines)


def realised_mix(drawn: list[dict[str, int]]) -> str:
    """'long 74.8% (1,531,904 tokens), short 25.2% (...)': the share of the
    target tokens each source gave, over the steps whose draws are listed."""
    totals: dict[str, int] = {}
    for step in drawn:
        for name, tokens in step.items():
            totals[name] = totals.get(name, 0) + tokens
    everything = sum(totals.values()) or 1
    return ", ".join(f"{name} {tokens / everything:.1%} ({tokens:,} tokens)" for name, tokens in totals.items())


def nothing_to_do(config: Config, step: int, until_step: int | None) -> str:
    """One line for a run whose checkpoint is already at the last step asked for."""
    where = f"run_dir {config.run_dir!r}" if config.run_dir else f"checkpoint.dir {config.checkpoint.dir!r}"
    if until_step is not None and until_step < config.train.steps:
        return (f"{where} is already at step {step}, past --until-step {until_step}; nothing to train "
                f"(raise --until-step, up to train.steps={config.train.steps})")
    return (f"{where} already finished: step {step} of train.steps={config.train.steps} is checkpointed; "
            f"to train on, raise train.steps (e.g. train.steps={2 * config.train.steps}), or choose a new run_dir "
            "and checkpoint.dir to start over")


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    """The loss of every step in metrics.jsonl (all sessions of the run) against the step."""
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    figure, axes = pyplot().subplots(figsize=(7, 4))
    axes.plot([r["step"] for r in records], [r["loss"] for r in records], linewidth=1.2)
    axes.set_xlabel("step")
    axes.set_ylabel("loss (next-token cross-entropy)")
    axes.set_title(metrics_path.parent.name)
    axes.grid(alpha=0.3)
    save(figure, png_path)
