"""Objectives: what a run trains for, one module each behind one interface
(`base.Objective`), named by `train.objective`:

- `lm` (`language_model`): next-token cross-entropy;
- `dpo` (`dpo`, its reference policy in `dpo_reference`): preference pairs;
- `grpo` (`grpo`, its rollouts in `rollouts`, its reward functions in
  `rewards`): reinforcement learning on rollouts of prompts.

The training program takes its loss from the objective, the loop its
batches; neither knows which objective it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jlong.objectives.base import Objective
from jlong.objectives.dpo import DIRECT_PREFERENCE
from jlong.objectives.grpo import GROUP_RELATIVE
from jlong.objectives.language_model import LANGUAGE_MODELLING

if TYPE_CHECKING:
    from jlong.config import Config

OBJECTIVES: dict[str, Objective] = {o.name: o for o in (LANGUAGE_MODELLING, DIRECT_PREFERENCE, GROUP_RELATIVE)}


def objective_of(config: Config) -> Objective:
    return OBJECTIVES[config.train.objective]


__all__ = ["OBJECTIVES", "Objective", "objective_of"]
