"""Where a run's metrics go besides run_dir/metrics.jsonl (`train.log_to`):
TensorBoard event files (tensorboardX, no TensorFlow) in run_dir/tensorboard,
and Weights & Biases (offline with WANDB_MODE=offline). Each gets the values
metrics.jsonl holds, under the same names: `train/<key>` for a step's
numbers (`train/stage` marks a staged run's boundaries), `eval/loss`,
`eval/loss_by_position/<start>-<end>`, `eval/loss_by_source/<name>` and
`eval/passkey/<length>-<depth>` for an evaluation's, and
`data/tokens_by_source/<name>` for what a mixture's step drew."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import uuid
from pathlib import Path

from jlong.errors import JlongError

TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"  # W&B's own directory under run_dir
_WANDB_RUN_ID = "jlong_run_id"  # in it: the W&B run this run directory logs to


def check_available(log_to) -> None:
    """Refuses a sink whose package is not installed, before anything is built."""
    if "wandb" in log_to and "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None:
        raise JlongError("train.log_to names wandb, which is not installed: pip install 'jlong[wandb]', "
                         "or drop wandb from train.log_to")


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
        elif key == "eval_loss_by_source":
            values.update({f"eval/loss_by_source/{name}": loss for name, loss in value.items()})
        elif key == "tokens_by_source":
            values.update({f"data/tokens_by_source/{name}": tokens for name, tokens in value.items()})
        elif key == "eval_passkey":
            values.update({f"eval/passkey/{c['length']}-{c['depth']:g}": c["accuracy"] for c in value})
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
    def __init__(self, run_dir: Path, config: dict, *, resumed: bool):
        check_available(["wandb"])
        import wandb

        # One W&B run per run of the directory: a resumed run continues it, a fresh start begins another.
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jlong"), name=run_dir.name,
                              id=_wandb_run_id(run_dir, resumed), resume="allow", dir=str(run_dir), config=config)

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id kept in run_dir/wandb: new on a fresh start; on a resume
    the kept one (or, for a directory from before ids were kept, its path's hash)."""
    kept = run_dir / WANDB_DIR / _WANDB_RUN_ID
    if resumed and kept.is_file():
        return kept.read_text().strip()
    if resumed:
        return "jlong-" + hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
    run_id = "jlong-" + uuid.uuid4().hex[:16]
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(run_id + "\n")
    return run_id
