"""What an objective is: the seam between the training loop and what it trains for.

An objective says what a step's batch holds (`batch_layout`), where batches
come from (`batches`: a source whose `batch(step)` is a pure function of the
step, or, for reinforcement learning, of the step and the policy's current
weights), what must happen once before training (`before_training`: DPO's
reference log-probabilities), and, inside the compiled step, its loss and
metrics from what the model gives (`loss_and_metrics`: per-token or
per-document log-probabilities, tiled along the sequence, never [S, V]).
The training loop and the program call these without knowing which
objective runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jlong.config import Config


class Objective:
    name: str = ""  # train.objective
    per_row: frozenset[str] = frozenset()  # batch arrays of one value per row (not laid out along the sequence)
    metric_names: tuple[str, ...] = ()  # what its steps log besides loss and grad_norm (`jlong.training.metric_names`)

    def batch_layout(self, config: Config) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """(shape, dtype) of each array of a step's batch."""
        raise NotImplementedError

    def batches(self, config: Config):
        """The source of the run's batches, its inputs read and checked before anything is built."""
        raise NotImplementedError

    def before_training(self, stages: list[tuple[Config, Any]], say: Callable[[str], None],
                        make_program: Callable) -> None:
        """Runs once before the first step, before any weights are on the devices: each stage's config and
        source; `make_program(config)` builds a training program on the run's mesh."""

    def batch(self, source, step: int, program, params: dict) -> dict[str, np.ndarray]:
        """Step `step`'s global batch (numpy), given the training program and the policy's weights as they
        are before the step."""
        return source.batch(step)

    def saved_state(self, source, step: int) -> dict | None:
        """What a checkpoint at `step` keeps of the source so that a resumed run continues as an
        uninterrupted one would (None: nothing, the step says it all)."""
        return None

    def restore_state(self, source, state: dict | None) -> None:
        """Takes back what `saved_state` kept."""

    def after_step(self, program, params: dict, step: int, say: Callable[[str], None]) -> None:
        """Runs after step `step` updated `params` (GRPO: the weights exported for an inference engine)."""

    def loss_and_metrics(self, program, params: dict, batch: dict):
        """Inside the compiled step: (the loss to differentiate, its metrics) of a placed batch."""
        raise NotImplementedError
