"""Group Relative Policy Optimization (GRPO) at long context, with TRL's
loss and metrics, on every layout and kernel the language-modelling step
runs.

Each step trains on one batch of rollouts (`jlong.objectives.rollouts`): a
few prompts, G completions each, from jlong's sampler on the training mesh
(or another engine's file), scored by the reward functions. Each completion
and its prompt are one document of the step's rows; the model gives the
per-token log-probabilities of logits / temperature and their entropies,
tiled as the loss is (`Transformer.token_logprobs_and_routing`: no [S, V]
array), and the loss is TRL's:

    ratio = exp(log p - old log p)
    loss per token = -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A)
                     + beta (exp(ref - log p) - (ref - log p) - 1)

over the completion tokens, normalised per `rl.loss_type` as TRL does on one
process: `dapo`, `bnpo` by the batch's completion tokens, `grpo` each
completion's mean then the mean over the completions, `dr_grpo` by the
completions x max_new_tokens. The old log-probabilities are the sampler's
(the file's, as they stand). The reference policy of the KL term (beta > 0)
is the frozen base with the adapters off (LoRA, in the same step) or the
starting weights, held on the devices beside the policy (the second copy
`jlong plan` counts) and run over each step's rows before the step.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jlong.attention.methods import method_of
from jlong.config import Config
from jlong.config.huggingface import hf_stop_ids
from jlong.data.prompts import PromptEncoder, read_prompts
from jlong.errors import JlongError
from jlong.model.document_sums import slot_sums
from jlong.objectives.base import Objective
from jlong.objectives.rewards import load_rewards
from jlong.objectives.weights_export import export_weights
from jlong.objectives.rollouts import (Rollouts, advantages, read_rollouts_file, rollout_metrics, rows,
                                       score_completions)
from jlong.parallel.placement import replicated

REFERENCE_TOKEN_LOGPS = "reference_token_logps"  # full fine-tuning, beta > 0: the reference policy's, per token
ROW_ARRAYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask", "old_logps", "advantages", "documents")
STEP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy", "kl")
ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length",
                   "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                   "completions/mean_terminated_length", "completions/min_terminated_length",
                   "completions/max_terminated_length", "num_tokens", "rollout_time_s", "sampler_tokens_per_s")


@dataclasses.dataclass(frozen=True)
class LossSettings:
    loss_type: str
    low: float  # the ratio is clipped to [1 - low, 1 + high]
    high: float
    beta: float
    completions: int  # of the step: prompts_per_step x num_generations
    max_completion_length: int
    documents: int  # slots per row (attention.max_documents)

    @classmethod
    def of(cls, config: Config) -> LossSettings:
        rl = config.rl
        return cls(rl.loss_type, rl.epsilon, rl.clip_high, rl.beta, rl.prompts_per_step * rl.num_generations,
                   rl.max_new_tokens, config.attention.max_documents)


def grpo_loss(logprobs_BS, entropy_BS, batch: dict, settings: LossSettings, reference_BS=None):
    """(TRL's GRPO loss of the batch's completion tokens, TRL's step metrics)."""
    mask = batch["loss_mask"].astype(jnp.float32)
    advantage, old = batch["advantages"], jax.lax.stop_gradient(batch["old_logps"])
    ratio = jnp.exp(logprobs_BS - old)
    clipped = jnp.clip(ratio, 1 - settings.low, 1 + settings.high)
    per_token = -jnp.minimum(ratio * advantage, clipped * advantage)
    tokens = jnp.maximum(mask.sum(), 1.0)

    def mean(x):  # over the completion tokens of the batch
        return (jax.lax.stop_gradient(x) * mask).sum() / tokens

    metrics = {}
    if reference_BS is not None:
        delta = jax.lax.stop_gradient(reference_BS) - logprobs_BS
        kl = jnp.exp(delta) - delta - 1
        per_token = per_token + settings.beta * kl
        metrics["kl"] = mean(kl)
    masked = per_token * mask
    if settings.loss_type == "grpo":
        sums = slot_sums(masked, batch["documents"], settings.documents)
        counts = slot_sums(mask, batch["documents"], settings.documents)
        loss = (sums / jnp.maximum(counts, 1.0)).sum() / settings.completions
    elif settings.loss_type == "dr_grpo":
        loss = masked.sum() / (settings.completions * settings.max_completion_length)
    else:  # dapo, bnpo: one process, the whole batch at once
        loss = masked.sum() / tokens
    low = (ratio < 1 - settings.low) & (advantage < 0)
    high = (ratio > 1 + settings.high) & (advantage > 0)
    metrics.update({"clip_ratio/low_mean": mean(low.astype(jnp.float32)),
                    "clip_ratio/high_mean": mean(high.astype(jnp.float32)),
                    "clip_ratio/region_mean": mean((low | high).astype(jnp.float32)),
                    "entropy": mean(entropy_BS)})
    return loss, metrics


class GroupRelative(Objective):
    name = "grpo"
    metric_names = (*STEP_METRICS, *ROLLOUT_METRICS)

    def batch_layout(self, config: Config):
        shape = (config.train.batch_size, config.train.seq_len)
        dtypes = {"loss_mask": np.bool_, "old_logps": np.float32, "advantages": np.float32}
        layout = {key: (shape, np.dtype(dtypes.get(key, np.int32))) for key in ROW_ARRAYS}
        if config.rl.beta and config.lora is None:
            layout[REFERENCE_TOKEN_LOGPS] = (shape, np.dtype(np.float32))
        return layout

    def batches(self, config: Config) -> GroupBatches:
        return GroupBatches(config)

    def before_training(self, stages, say, make_program) -> None:
        config, source = stages[0]
        rl = config.rl
        where = (f"rl.rollouts ({len(source.file_groups)} groups of {rl.num_generations})" if source.file_groups
                 else f"jlong's sampler on the training mesh ({len(source.prompts)} prompts of rl.prompts, "
                      f"{rl.num_generations} completions each, up to {rl.max_new_tokens} new tokens)")
        reference = ("" if not rl.beta else "; the KL's reference policy: " + (
            "the base, the adapters off, in the same step" if config.lora else
            "the starting weights, a second copy on the devices"))
        say(f"GRPO: {rl.prompts_per_step} group(s) a step from {where}, each used for {rl.num_iterations} step(s); "
            f"loss {rl.loss_type}{reference}")

    def batch(self, source: GroupBatches, step, program, params):
        return source.batch(step, program, params)

    def after_step(self, program, params, step, say) -> None:
        """rl.export_every: the weights for the engine that writes rl.rollouts (`jlong.objectives.weights_export`)."""
        rl = program.config.rl
        if rl.export_every and step % rl.export_every == 0:
            say(f"exported step {step}'s weights to {export_weights(program, params, rl.export_dir)}")

    def saved_state(self, source: GroupBatches, step: int) -> dict:
        return source.state(step)

    def restore_state(self, source: GroupBatches, state: dict | None) -> None:
        source.restore(state)

    def loss_and_metrics(self, program, params, batch):
        config = program.config
        rl = config.rl
        model = program.bind(params)
        (logprobs, entropy), routing = model.token_logprobs_and_routing(batch, rl.temperature)
        reference = None
        if rl.beta:
            if program.lora:  # the base, the adapters off, no gradient
                base = program.base_model(jax.lax.stop_gradient(params))
                reference = jax.lax.stop_gradient(base.token_logprobs_and_routing(batch, rl.temperature)[0][0])
            else:
                reference = batch[REFERENCE_TOKEN_LOGPS]
        loss, metrics = grpo_loss(logprobs, entropy, batch, LossSettings.of(config), reference)
        return model.with_routing(loss, metrics, routing)


GROUP_RELATIVE = GroupRelative()


class GroupBatches:
    """Each step's rows of rollouts, and their metrics. The inputs (prompts or rollouts file, reward
    functions) are read and checked when this is made, before anything compiles."""

    def __init__(self, config: Config):
        self.config, rl = config, config.rl
        self.functions = load_rewards(rl.rewards, rl.reward_weights) if rl.rewards else []
        self.encoder = PromptEncoder(config.data.tokenizer, config.model.vocab_size)
        hf = config.model.hf_path
        self.stop_ids = tuple(dict.fromkeys((*rl.stop_ids, *(hf_stop_ids(hf) if hf else ()))))
        self.prompts, self.file_groups = [], []
        if rl.prompts:
            self.prompts = read_prompts(rl.prompts, self.encoder, "rl.prompts")
            room = config.train.seq_len - rl.max_new_tokens
            for number, prompt in enumerate(self.prompts):
                if len(prompt.ids) > room:
                    raise JlongError(f"rl.prompts: prompt {number} has {len(prompt.ids):,} tokens, more than "
                                     f"train.seq_len - rl.max_new_tokens ({room:,}): raise train.seq_len or shorten it")
        else:
            self.file_groups = read_rollouts_file(
                rl.rollouts, groups=rl.num_generations, functions=self.functions, vocab_size=config.model.vocab_size,
                max_new_tokens=rl.max_new_tokens, seq_len=config.train.seq_len, stop_ids=self.stop_ids)
        self.current: tuple[int, Rollouts] | None = None  # (group of steps, its rollouts)
        self.num_tokens = 0  # prompt and completion tokens trained on so far (TRL's num_tokens)
        self.counted: dict[int, int] = {}  # step -> num_tokens after it
        self._samplers: dict[int, object] = {}
        self._reference = None  # beta > 0, full fine-tuning: (program, the starting weights, their forward)

    def batch(self, step: int, program, params) -> dict[str, np.ndarray]:
        rl = self.config.rl
        group = (step - 1) // rl.num_iterations
        if self.current is None or self.current[0] != group:
            self.current = (group, self._rollouts(group, program, params))
        rollouts = self.current[1]
        arrays = rows(rollouts, advantages(rollouts.total, rl.num_generations, rl.scale_rewards),
                      seq_len=self.config.train.seq_len, batch_size=self.config.train.batch_size,
                      max_documents=self.config.attention.max_documents,
                      mask_truncated=rl.mask_truncated_completions)
        if REFERENCE_TOKEN_LOGPS in program.abstract_batch:
            arrays[REFERENCE_TOKEN_LOGPS] = self._reference_logprobs(program, arrays)
        self.num_tokens = self.counted.get(step - 1, self.num_tokens) + sum(
            len(p) + len(c) for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids))
        self.counted = {step: self.num_tokens}
        return arrays

    def drawn(self, step: int) -> dict:
        rollouts = self.current[1]
        return {**rollout_metrics(rollouts, self.config.rl.max_new_tokens), "num_tokens": self.num_tokens,
                "rollout_time_s": rollouts.seconds, "sampler_tokens_per_s": rollouts.tokens_per_s}

    def state(self, step: int) -> dict:
        """The prompt cursor and, between the steps of one batch of rollouts, the batch itself."""
        rl = self.config.rl
        group = (step - 1) // rl.num_iterations
        pending = step % rl.num_iterations != 0 and self.current is not None and self.current[0] == group
        return {"grpo": {"group": group, "next_prompt": ((group + 1) * rl.prompts_per_step) % max(len(self.prompts), 1),
                         "num_tokens": self.num_tokens,
                         "rollouts": self.current[1].to_json() if pending else None}}

    def restore(self, state: dict | None) -> None:
        saved = (state or {}).get("grpo")
        if not saved:
            return
        self.num_tokens = saved["num_tokens"]
        self.counted = {}
        if saved["rollouts"] is not None:
            self.current = (saved["group"], Rollouts.from_json(saved["rollouts"]))

    def _rollouts(self, group: int, program, params) -> Rollouts:
        rl = self.config.rl
        if self.file_groups:
            first = group * rl.prompts_per_step
            chosen = [self.file_groups[(first + i) % len(self.file_groups)] for i in range(rl.prompts_per_step)]
            return _joined(chosen)
        return self._sample(group, program, params)

    def _sample(self, group: int, program, params) -> Rollouts:
        from jlong.generation.sampler import Request, Sampler
        from jlong.generation.sampling import SamplingSettings

        rl, config = self.config.rl, self.config
        indices = [(group * rl.prompts_per_step + i) % len(self.prompts) for i in range(rl.prompts_per_step)]
        prompts = [self.prompts[i] for i in indices]
        sampler = self._samplers.setdefault(id(program), Sampler(program))
        request = Request(rl.max_new_tokens, SamplingSettings(rl.temperature, rl.top_k, rl.top_p), rl.num_generations,
                          seed=config.train.seed * 1_000_003 + group, stop_ids=self.stop_ids)
        began = time.perf_counter()
        completions = sampler.generate(params, [p.ids for p in prompts], request, batch_size=rl.prompts_per_step,
                                       prompt_indices=indices)
        seconds = time.perf_counter() - began
        ids = [c.ids for c in completions]
        table, total = score_completions(self.functions, prompts, ids, rl.num_generations,
                                         None if self.encoder.tokenizer is None else self.encoder.decode)
        return Rollouts(rl.num_generations, [p.ids for p in prompts for _ in range(rl.num_generations)], ids,
                        [c.logprobs for c in completions], table, [f.name for f in self.functions], total,
                        np.array([c.finish_reason == "stop" for c in completions]),
                        [i for i in indices for _ in range(rl.num_generations)], seconds,
                        sum(map(len, ids)) / max(seconds, 1e-9))

    def _reference_logprobs(self, program, arrays: dict[str, np.ndarray]) -> np.ndarray:
        """The starting weights' per-token log-probabilities of the rows (beta > 0, full fine-tuning)."""
        if self._reference is None or self._reference[0] is not program:
            weights = program.starting_params()
            forward = jax.jit(lambda params, batch: program.bind(program.optimizer.compute_params(
                params, program.param_shardings)).token_logprobs_and_routing(batch, self.config.rl.temperature)[0][0],
                in_shardings=(program.rest_shardings, None), out_shardings=replicated(program.mesh))
            self._reference = (program, weights, forward)
        _, weights, forward = self._reference
        placed = program.place_batch({key: arrays[key] for key in ("inputs", "targets", "segment_ids", "positions")})
        return method_of(self.config).layout(self.config).restore(np.asarray(jax.device_get(forward(weights, placed))))


def _joined(batches: list[Rollouts]) -> Rollouts:
    first = batches[0]
    return Rollouts(first.groups, [x for b in batches for x in b.prompt_ids], [x for b in batches for x in b.completion_ids],
                    [x for b in batches for x in b.old_logprobs], np.concatenate([b.rewards for b in batches]),
                    first.reward_names, np.concatenate([b.total for b in batches]),
                    np.concatenate([b.terminated for b in batches]), [x for b in batches for x in b.prompt_indices])
