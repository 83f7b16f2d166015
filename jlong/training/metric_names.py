"""The names a train step writes, declared once: each key of a run_dir/metrics.jsonl record (when a step has it
and what it means), the parts of the keys whose values are per-source mappings or lists, and the scalar names
TensorBoard and W&B get (`jlong.training.metric_sinks.scalars`).

The metrics reference of the documentation is generated from this table (`jlong.docgen`), and
tests/test_docs_site.py checks it against the records of real steps: every key a step writes is declared here,
and every metric declared for every step is written.
"""

from __future__ import annotations

import dataclasses
import re

EVERY_STEP = "every step"
GRPO = "train.objective=grpo"
EVALUATION = ("evaluation steps, with eval.path or eval.mix: every train.eval_every steps, and in a run in stages "
              "each stage's last step")


@dataclasses.dataclass(frozen=True)
class Metric:
    """One key of a metrics.jsonl record."""

    name: str
    when: str  # EVERY_STEP, or the runs and steps that have it
    meaning: str

    @property
    def every_step(self) -> bool:
        return self.when == EVERY_STEP


@dataclasses.dataclass(frozen=True)
class NamePattern:
    """Names made from a pattern: `<part>` stands for a name or number of the run's own (a source's name, a
    bucket's bounds)."""

    pattern: str
    meaning: str

    def matches(self, name: str) -> bool:
        pieces = re.split(r"(<[a-z_]+>)", self.pattern)
        regex = "".join(".+" if piece.startswith("<") else re.escape(piece) for piece in pieces)
        return re.fullmatch(regex, name) is not None


METRICS: tuple[Metric, ...] = (
    Metric("step", EVERY_STEP, "The step's number, from 1."),
    Metric("loss", EVERY_STEP, "The training loss of the step's batch, before its update: the mean next-token "
           "cross-entropy over the target tokens that count (`dpo`: the mean DPO loss over the batch's pairs; "
           "`grpo`: TRL's loss of the completion tokens, normalised per rl.loss_type), plus "
           "model.router_aux_loss_coef x the load-balancing loss where a mixture of experts trains it."),
    Metric("grad_norm", EVERY_STEP, "The global norm of the step's gradients, before clipping (train.grad_clip)."),
    Metric("lr", EVERY_STEP, "The learning rate of the step: linear warmup to train.lr, then cosine decay to "
           "train.min_lr_ratio x train.lr."),
    Metric("seq_len", EVERY_STEP, "The step's train.seq_len (in a run in stages, its stage's)."),
    Metric("tokens_per_s", EVERY_STEP, "train.batch_size x train.seq_len / step_time_s."),
    Metric("step_time_s", EVERY_STEP, "Seconds from the placed batch to the step's metrics read back."),
    Metric("trained_tokens", EVERY_STEP, "The target tokens that count in the loss (those the loss mask keeps)."),
    Metric("peak_bytes", "on a GPU", "The peak bytes in use on the process's first device so far."),
    Metric("mfu", "on a GPU whose peak FLOP rate jlong knows", "Model FLOPs utilisation: tokens_per_s x the "
           "model's FLOPs per token (6 x its matmul parameters plus causal attention; recomputation not counted) "
           "over the devices' peak FLOP rate."),
    Metric("stage", "a run in stages", "The stage the step belongs to, from 1."),
    Metric("tokens_by_source", "data.mix", "The target tokens each source of the mixture gave the step, by the "
           "source's name."),
    Metric("eval_loss", EVALUATION, "The mean held-out loss of eval.sequences windows of train.seq_len."),
    Metric("eval_loss_by_position", EVALUATION, "The held-out loss by position: one entry per power-of-two bucket "
           "of positions."),
    Metric("eval_loss_by_source", "evaluation steps, with eval.mix", "The held-out loss of each eval.mix corpus, "
           "by its name."),
    Metric("eval_passkey", "a run in stages: each stage's last step, with held-out tokens and "
           "eval.passkey_trials > 0", "Passkey retrieval: one entry per (length, depth) cell."),
    Metric("expert_load_max_over_mean", "a mixture of experts", "The busiest expert's tokens over the mean "
           "expert's, in the layer where that is largest (1: balanced; num_experts / num_experts_per_tok: "
           "collapsed routing, which a warning reports when it lasts)."),
    Metric("router_aux_loss", "a mixture of experts with train.router_aux_loss", "The load-balancing loss, as "
           "transformers computes it (the training loss adds model.router_aux_loss_coef x it)."),
    Metric("rewards/chosen", "train.objective=dpo", "The mean reward of the chosen completions: beta x (the "
           "policy's log-probability - the reference's)."),
    Metric("rewards/rejected", "train.objective=dpo", "The mean reward of the rejected completions."),
    Metric("rewards/accuracies", "train.objective=dpo", "The share of pairs whose chosen reward is above the "
           "rejected one."),
    Metric("rewards/margins", "train.objective=dpo", "The mean chosen reward - rejected reward."),
    Metric("logps/chosen", "train.objective=dpo", "The mean summed log-probability of the chosen completions under "
           "the policy."),
    Metric("logps/rejected", "train.objective=dpo", "The mean summed log-probability of the rejected completions "
           "under the policy."),
    Metric("pairs", "train.objective=dpo", "The preference pairs in the step's batch."),
    # GRPO: TRL's names (trl 1.x GRPOTrainer), over the step's rollouts and its completion tokens.
    Metric("reward", GRPO, "The mean reward of the step's completions (each the weighted sum of its reward "
           "functions' values, those that gave none left out)."),
    Metric("reward_std", GRPO, "The mean over the step's groups of their rewards' standard deviation."),
    Metric("frac_reward_zero_std", GRPO, "The share of the step's groups whose rewards are all equal (they carry "
           "no advantage)."),
    Metric("completions/mean_length", GRPO, "The mean completion length in tokens."),
    Metric("completions/min_length", GRPO, "The shortest completion."),
    Metric("completions/max_length", GRPO, "The longest completion."),
    Metric("completions/clipped_ratio", GRPO, "The share of completions cut at rl.max_new_tokens (no stop id)."),
    Metric("completions/mean_terminated_length", GRPO, "The mean length of the completions that ended at a stop id "
           "(0 without any)."),
    Metric("completions/min_terminated_length", GRPO, "The shortest of those."),
    Metric("completions/max_terminated_length", GRPO, "The longest of those."),
    Metric("clip_ratio/low_mean", GRPO, "The share of completion tokens whose ratio is below 1 - rl.epsilon with a "
           "negative advantage (clipped)."),
    Metric("clip_ratio/high_mean", GRPO, "The share whose ratio is above 1 + rl.epsilon_high with a positive "
           "advantage."),
    Metric("clip_ratio/region_mean", GRPO, "The share clipped either way."),
    Metric("entropy", GRPO, "The mean entropy of the policy (of logits / rl.temperature) at the completion tokens."),
    Metric("kl", "train.objective=grpo with rl.beta > 0", "The mean k3 estimate of the KL to the reference policy at "
           "the completion tokens."),
    Metric("num_tokens", GRPO, "Prompt and completion tokens trained on so far."),
    Metric("rollout_time_s", GRPO, "Seconds the step's rollouts took (sampling, then scoring); 0 for rollouts read "
           "from rl.rollouts; a batch of rollouts serving several steps (rl.num_iterations) shows its time at each."),
    Metric("sampler_tokens_per_s", GRPO, "The sampler's new tokens per second in the step's rollouts."),
)

# GRPO's per reward function metrics: rewards/<function>/mean and /std.
REWARD_FUNCTIONS: tuple[NamePattern, ...] = (
    NamePattern("rewards/<function>/mean", "The mean value a reward function gave the step's completions (those it "
                "scored)."),
    NamePattern("rewards/<function>/std", "Their standard deviation."),
)

# The keys whose values are per-source mappings: their keys are the sources' names (eval.mix's and data.mix's
# `name`, by default the path's stem), written `metric.<source>`.
PER_SOURCE: tuple[NamePattern, ...] = (
    NamePattern("tokens_by_source.<source>", "The target tokens the data.mix source gave the step."),
    NamePattern("eval_loss_by_source.<source>", "The held-out loss of the eval.mix corpus."),
)

# The keys whose values are lists of entries, and each entry's keys.
ENTRIES: dict[str, dict[str, str]] = {
    "eval_loss_by_position": {
        "start": "The bucket's first position.",
        "end": "The position after its last.",
        "tokens": "The held-out target tokens in the bucket.",
        "loss": "Their mean loss.",
    },
    "eval_passkey": {
        "length": "The prompts' length in tokens.",
        "depth": "Where the key sits, as a share of the prompt (eval.passkey_depths).",
        "trials": "The cell's trials.",
        "accuracy": "The share of trials with every digit of the key the model's most likely next token.",
        "digit_accuracy": "The share of the key's tokens right, each given the true ones before it.",
    },
}

# The scalars TensorBoard (run_dir/tensorboard) and W&B get from each record (`metric_sinks.scalars`).
LOGGED: tuple[NamePattern, ...] = (
    NamePattern("train/<metric>", "Every number of the record but step and the evaluation's: train/loss, "
                "train/rewards/chosen, ..."),
    NamePattern("eval/loss", "eval_loss."),
    NamePattern("eval/loss_by_position/<start>-<end>", "Each bucket of eval_loss_by_position."),
    NamePattern("eval/loss_by_source/<source>", "Each corpus of eval_loss_by_source."),
    NamePattern("eval/passkey/<length>-<depth>", "The accuracy of each cell of eval_passkey."),
    NamePattern("data/tokens_by_source/<source>", "Each source of tokens_by_source."),
)


def metric_named(name: str) -> Metric | None:
    return next((metric for metric in METRICS if metric.name == name), None)


def undeclared(record: dict) -> list[str]:
    """The names in a metrics.jsonl record that this module does not declare (the keys, each per-source
    mapping's as `key.<name>`, each list entry's as `key[].<field>`)."""
    missing = []
    for key, value in record.items():
        if metric_named(key) is None and not any(p.matches(key) for p in REWARD_FUNCTIONS):
            missing.append(key)
        elif isinstance(value, dict):
            missing += [f"{key}.{part}" for part in value if not any(p.matches(f"{key}.{part}") for p in PER_SOURCE)]
        elif isinstance(value, list):
            fields = ENTRIES.get(key, {})
            missing += sorted({f"{key}[].{field}" for entry in value for field in entry if field not in fields})
    return missing
