"""Language modelling: the mean next-token cross-entropy over the trained
targets of windows or packed documents of token files (`jlong.data.sources`),
a mixture of experts' load-balancing loss added as configured."""

from __future__ import annotations

from jlong.data.sources import Batches, batch_layout
from jlong.objectives.base import Objective


class LanguageModelling(Objective):
    name = "lm"

    def batch_layout(self, config):
        return batch_layout(config)

    def batches(self, config):
        return Batches.from_config(config)

    def loss_and_metrics(self, program, params, batch):
        return program.bind(params).loss_and_metrics(batch)


LANGUAGE_MODELLING = LanguageModelling()
