"""A run's directory: its config, one JSON line of metrics per step (and the
same values in TensorBoard or W&B, with train.log_to), and the loss curve."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from jlong.config import Config, config_to_dict
from jlong.errors import JlongError
from jlong.train.metric_sinks import TensorBoard, WeightsAndBiases
from jlong.train.report import LOSS_PLOT, plot_losses

# What a resumed run may change: how long to train, how often to save, where its
# directories are (moved or named from another directory), and how the same
# mathematics is laid out on the devices: the mesh (device count, fsdp, sp,
# ring), attention's kernel and stages, and the memory knobs. The optimizer's
# offload is not one of them: it changes the state's layout and the gradients' dtype.
RESUMABLE_CHANGES = {
    "train.steps", "train.profile_start", "train.profile_steps", "train.gpu_memory_fraction",
    "train.check_host_memory", "checkpoint.every", "checkpoint.keep", "checkpoint.dir", "run_dir",
}
RESUMABLE_SECTIONS = ("mesh.", "attention.", "memory.")
NOT_RESUMABLE = {"memory.optimizer_offload"}


def resumable(key: str) -> bool:
    """Whether a resumed run may change `key`: the layout, the cadences, and what is measured and where it goes."""
    if key.startswith("eval.") or key in ("train.eval_every", "train.log_to"):
        return True
    return key in RESUMABLE_CHANGES or (key.startswith(RESUMABLE_SECTIONS) and key not in NOT_RESUMABLE)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "rope_scaling":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class RunDir:
    def __init__(self, config: Config):
        self.path = Path(config.run_dir)
        self.config_path = self.path / "config.yaml"
        self.metrics_path = self.path / "metrics.jsonl"
        self.config = config_to_dict(config)
        self.sinks: list = []  # train.log_to's, besides metrics.jsonl
        self.relaid: list[str] = []  # how the layout on the devices changed since the run's last session
        if self.config_path.is_file():
            before = _flatten(yaml.safe_load(self.config_path.read_text()) or {})
            now = _flatten(self.config)
            changed = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
            refused = [k for k in changed if not resumable(k)]
            if refused:
                raise JlongError(
                    f"run_dir {str(self.path)!r} belongs to a different configuration: {', '.join(refused[:4])} "
                    "changed, which changes the run's mathematics (a resumed run may change the mesh, attention, "
                    "memory knobs but memory.optimizer_offload, train.steps and checkpoint cadence); "
                    "choose a new run_dir"
                )
            self.relaid = [f"{k} {before.get(k)} -> {now.get(k)}" for k in changed if k.startswith(RESUMABLE_SECTIONS)]

    def start(self, resumed_at: int) -> None:
        """Writes the config; drops metrics of steps after the resumed checkpoint; opens the train.log_to sinks."""
        self.path.mkdir(parents=True, exist_ok=True)
        _write_atomically(self.config_path, yaml.safe_dump(self.config, sort_keys=False))
        if self.metrics_path.is_file():
            kept = [line for line in self.metrics_path.read_text().splitlines()
                    if _logged_step(line) <= resumed_at]
            _write_atomically(self.metrics_path, "".join(line + "\n" for line in kept))
        log_to = self.config["train"]["log_to"]
        if "tensorboard" in log_to:
            self.sinks.append(TensorBoard(self.path, resumed_at))
        if "wandb" in log_to:
            self.sinks.append(WeightsAndBiases(self.path, self.config))

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


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
