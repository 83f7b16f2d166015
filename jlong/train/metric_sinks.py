"""Where a run's metrics go besides run_dir/metrics.jsonl (`train.log_to`):
TensorBoard event files (tensorboardX, no TensorFlow) in run_dir/tensorboard,
and Weights & Biases (offline with WANDB_MODE=offline). Each gets the values
metrics.jsonl holds, under the same names: `train/<key>` for a step's
numbers, `eval/loss` and `eval/loss_by_position/<start>-<end>` for an
evaluation's."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from jlong.errors import JlongError

TENSORBOARD_DIR = "tensorboard"


def scalars(record: dict) -> dict[str, float]:
    """A metrics record's numbers by their logged names."""
    values = {}
    for key, value in record.items():
        if key == "step":
            continue
        if key == "eval_loss_by_position":
            values.update({f"eval/loss_by_position/{b['start']}-{b['end']}": b["loss"] for b in value})
        elif key == "eval_loss":
            values["eval/loss"] = value
        elif isinstance(value, (int, float)):
            values[f"train/{key}"] = value
    return values


class TensorBoard:
    def __init__(self, run_dir: Path, resumed_at: int):
        from tensorboardX import SummaryWriter

        # A resumed run's steps replace those logged after its checkpoint.
        self.writer = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=resumed_at + 1 if resumed_at else None)

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WeightsAndBiases:
    def __init__(self, run_dir: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise JlongError("train.log_to: wandb needs the wandb package: pip install 'jlong[wandb]'") from None
        # One W&B run per run directory, resumed with it; WANDB_MODE=offline keeps it on disk.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jlong"), name=run_dir.name,
                              id="jlong-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16],
                              resume="allow",
                              dir=str(run_dir), config=config)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()
