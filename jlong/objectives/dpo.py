"""Direct Preference Optimization (DPO) on preference pairs, against a
reference policy that costs no second copy of the weights.

A batch row holds whole pairs (`data.sampling: pairs`, `jlong.data.pairs`);
the model gives each completion's sum of log-probabilities
(`Transformer.document_logps_and_routing`). The reference policy is the
frozen base with the adapters off (LoRA: computed in the same step), or,
with full fine-tuning, the starting weights' log-probabilities computed once
before the run holds its weights and carried by every batch
(`jlong.objectives.dpo_reference`).

The loss is the sigmoid loss, TRL's default:
-log sigmoid(beta ((pi_c - ref_c) - (pi_r - ref_r))) per pair, the batch's
loss the mean over its pairs; the metrics are TRL's, by TRL's names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlong.data.pairs import describe as describe_pairs
from jlong.data.sources import REFERENCE_LOGPS, Batches, batch_layout
from jlong.model.document_sums import slot_sums
from jlong.objectives.base import Objective
from jlong.objectives.dpo_reference import from_starting_weights, reference_logps

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "pairs")


def present_pairs(documents_BS, count: int):
    """[B, count // 2] True where the row holds pair p (its chosen completion has a token)."""
    tokens_BN = slot_sums(jnp.ones(documents_BS.shape, jnp.float32), documents_BS, count)
    return tokens_BN[:, 0:count - count % 2:2] > 0


def dpo_loss(policy_BN, reference_BN, present_BP, beta: float):
    """(the mean sigmoid DPO loss over the batch's pairs, TRL's metrics):
    documents 2p and 2p + 1 of each row are pair p's chosen and rejected."""
    reference_BN = jax.lax.stop_gradient(reference_BN)
    slots = 2 * present_BP.shape[1]  # an odd count's last slot holds no pair
    chosen, rejected = policy_BN[:, 0:slots:2], policy_BN[:, 1:slots:2]
    chosen_rewards = beta * (chosen - reference_BN[:, 0:slots:2])
    rejected_rewards = beta * (rejected - reference_BN[:, 1:slots:2])
    pairs = present_BP.astype(jnp.float32)
    count = jnp.maximum(pairs.sum(), 1.0)

    def mean(x):
        return (x * pairs).sum() / count

    loss = mean(-jax.nn.log_sigmoid(chosen_rewards - rejected_rewards))
    metrics = {
        "rewards/chosen": mean(chosen_rewards), "rewards/rejected": mean(rejected_rewards),
        "rewards/accuracies": mean((chosen_rewards > rejected_rewards).astype(jnp.float32)),
        "rewards/margins": mean(chosen_rewards - rejected_rewards),
        "logps/chosen": mean(chosen), "logps/rejected": mean(rejected),
        "pairs": pairs.sum(),
    }
    return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


class DirectPreference(Objective):
    name = "dpo"
    per_row = frozenset({REFERENCE_LOGPS})
    metric_names = METRICS

    def batch_layout(self, config):
        return batch_layout(config)

    def batches(self, config):
        return Batches.from_config(config)

    def before_training(self, stages, say, make_program) -> None:
        """Says which reference policy the run uses; with full fine-tuning, gives each stage's batches (of its
        data.path) their pairs' reference log-probabilities, read from the cache beside the file or computed
        with the starting weights. The longest rows go first: the pairs they compute serve shorter rows too."""
        for config, batches in stages:
            say(describe_pairs(batches.source, config.data.path))  # the pairs that fill the rows, those skipped
        if stages[0][0].lora:
            say("DPO's reference policy: the base model, the adapters off, in the same step (no second copy)")
            return
        for config, batches in sorted(stages, key=lambda each: -each[0].train.seq_len):
            source = batches.source
            batches.use_reference(reference_logps(config, source, config.data.path,
                                                  from_starting_weights(lambda: make_program(config), source), say))

    def loss_and_metrics(self, program, params, batch):
        config = program.config
        count = config.attention.max_documents
        if program.lora:  # the base, the adapters off, no gradient
            base = program.base_model(jax.lax.stop_gradient(params))
            reference = jax.lax.stop_gradient(base.document_logps_and_routing(batch, count)[0])
        else:
            reference = batch[REFERENCE_LOGPS]
        model = program.bind(params)
        policy, routing = model.document_logps_and_routing(batch, reference.shape[1])
        loss, metrics = dpo_loss(policy, reference, present_pairs(batch["pair_documents"], policy.shape[1]),
                                 config.train.dpo_beta)
        return model.with_routing(loss, metrics, routing)


DIRECT_PREFERENCE = DirectPreference()
