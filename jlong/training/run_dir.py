"""A run's directory: its config, one JSON line of metrics per step (and the
same values in TensorBoard or W&B, with train.log_to), and the loss curve.

A run continues in its directory only under the same mathematics
(`jlong.config.identity`). A fresh start (no checkpoint to resume) in a
directory that holds an earlier run's outputs moves them aside, into
`earlier/` there (`earlier-2/`, ... after that), and says so: nothing an
earlier run wrote is overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from jlong.config import Config, config_to_dict
from jlong.config.identity import changes
from jlong.errors import JlongError
from jlong.files import free_name, write_atomically
from jlong.training.metric_sinks import TENSORBOARD_DIR, WANDB_DIR, TensorBoard, WeightsAndBiases
from jlong.training.report import LOSS_PLOT, plot_losses

CONFIG, METRICS = "config.yaml", "metrics.jsonl"
PROFILE_DIR, EVAL_DIR = "profile", "eval"
# Everything a run writes into its directory; what a fresh start moves aside.
OUTPUTS = (CONFIG, METRICS, LOSS_PLOT, TENSORBOARD_DIR, WANDB_DIR, PROFILE_DIR, EVAL_DIR)


class RunDir:
    def __init__(self, config: Config):
        self.path = Path(config.run_dir)
        self.config_path = self.path / CONFIG
        self.metrics_path = self.path / METRICS
        self.config = config_to_dict(config)
        self.sinks: list = []  # train.log_to's, besides metrics.jsonl
        self.relaid: list[str] = []  # how the layout on the devices changed since the run's last session
        if self.config_path.is_file():
            found = changes(yaml.safe_load(self.config_path.read_text()) or {}, self.config)
            if found.refused:
                raise JlongError(
                    f"run_dir {str(self.path)!r} belongs to a different configuration: {', '.join(found.refused[:4])} "
                    "changed, which changes the run's mathematics (a resumed run may change the mesh, attention, "
                    "memory knobs but memory.optimizer_offload, train.steps and checkpoint cadence); "
                    "choose a new run_dir"
                )
            self.relaid = [f"{k} {found.before.get(k)} -> {found.now.get(k)}" for k in found.relaid]

    def start(self, resumed_at: int) -> list[str]:
        """Writes the config; sets aside what would be lost (an earlier run's
        outputs, on a fresh start) or drops what is trained again (metrics of
        steps after the resumed checkpoint); opens the train.log_to sinks.
        Returns the lines that say what it moved or dropped."""
        said = self._set_aside_earlier_run() if not resumed_at else self._drop_metrics_after(resumed_at)
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomically(self.config_path, yaml.safe_dump(self.config, sort_keys=False))
        log_to = self.config["train"]["log_to"]
        if "tensorboard" in log_to:
            self.sinks.append(TensorBoard(self.path, resumed_at))
        if "wandb" in log_to:
            self.sinks.append(WeightsAndBiases(self.path, self.config, resumed=bool(resumed_at)))
        return said

    def _set_aside_earlier_run(self) -> list[str]:
        """A fresh start: an earlier run's outputs (one that left no checkpoint to resume) go to earlier/."""
        present = [self.path / name for name in OUTPUTS if (self.path / name).exists()]
        if not [p for p in present if p.name != CONFIG]:  # at most a config: no step was ever logged
            return []
        aside = free_name(self.path / "earlier")
        aside.mkdir()
        for path in present:
            path.rename(aside / path.name)
        steps = _logged_steps(aside / METRICS)
        what = f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"
        return [f"run_dir {str(self.path)!r} held an earlier run's outputs ({what} logged, no checkpoint to "
                f"resume); moved them to {aside} and starting at step 1"]

    def _drop_metrics_after(self, resumed_at: int) -> list[str]:
        """A resumed run trains again the steps after its checkpoint: their lines go (and a line cut short)."""
        if not self.metrics_path.is_file():
            return []
        lines = self.metrics_path.read_text().splitlines()
        kept = [line for line in lines if _logged_step(line) <= resumed_at]
        write_atomically(self.metrics_path, "".join(line + "\n" for line in kept))
        again = sorted(int(step) for step in map(_logged_step, lines) if resumed_at < step < float("inf"))
        if not again:
            return []
        return [f"metrics of steps {again[0]}-{again[-1]} (after the checkpoint of step {resumed_at}) are "
                "dropped from metrics.jsonl: those steps are trained again"]

    def log(self, record: dict) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def plot_losses(self) -> None:
        """The run's loss curve so far, as run_dir/loss.png."""
        plot_losses(self.metrics_path, self.path / LOSS_PLOT)


def _logged_step(line: str) -> float:
    """The step a metrics line records; infinite for a blank line or one cut
    short by a crash, so that trimming drops it."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


def _logged_steps(metrics: Path) -> list[int]:
    """The steps a metrics file records, in order (none when there is no file)."""
    if not metrics.is_file():
        return []
    steps = (_logged_step(line) for line in metrics.read_text().splitlines())
    return sorted(int(step) for step in steps if step < float("inf"))
