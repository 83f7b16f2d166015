"""A GRPO step planned (`jlong plan` of `train.objective: grpo`): the
rollout (the sampler's prefill and decode of `rl.prompts_per_step` prompts of
the longest length the run allows, `rl.num_generations` completions each, all
to `rl.max_new_tokens`) beside the training step, each compiled and priced
on its own (`jlong.planner.generation`, `jlong.planner.step_cost`). No
prompts file is read: the lengths are the config's.

Memory: the rollout holds the training state it does not use (the
optimizer's, and with rl.beta > 0 and full fine-tuning the reference
policy's weights, a second copy) beside its own programs' peaks; both the
rollout's and the training step's total must fit. Times are estimates: a
step is its rollout (the prefill and max_new_tokens decode steps, every
completion running to the end) plus its training step (the reference
policy's forward over the rows not counted).
"""

from __future__ import annotations

import dataclasses

from jlong.config import Config
from jlong.planner.generation import GenerationPlan, plan_generation
from jlong.planner.memory import MemoryPlan, shard_bytes
from jlong.planner.pricing import Efficiency
from jlong.planner.targets import GIB, PlanTarget


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    generation: GenerationPlan
    optimizer_state: int  # per device, held through the rollout
    reference: int  # per device: the reference policy's weights (full fine-tuning with rl.beta > 0), else 0
    training_step_s: float | None

    @property
    def rollout_s(self) -> float | None:
        plan = self.generation
        return None if plan.prefill_s is None else plan.prefill_s + plan.new_tokens * plan.decode_step_s

    @property
    def step_s(self) -> float | None:
        if self.rollout_s is None or self.training_step_s is None:
            return None
        return self.rollout_s + self.training_step_s

    @property
    def device_total(self) -> int:
        return self.generation.device_total + self.optimizer_state + self.reference

    @property
    def fits(self) -> bool:
        return self.device_total <= self.generation.budget

    def as_dict(self) -> dict:
        return {"generation": self.generation.as_dict(), "optimizer_state": self.optimizer_state,
                "reference_policy": self.reference, "device_total": self.device_total, "fits": self.fits,
                "rollout_time_s": self.rollout_s, "grpo_step_time_s": self.step_s}

    def lines(self) -> list[str]:
        plan, gib = self.generation, GIB
        lines = [f"GRPO rollout: {plan.batch // plan.samples} prompt(s) of {plan.prompt_tokens:,} tokens x "
                 f"{plan.samples} completions of up to {plan.new_tokens:,} tokens; caches {plan.cache / gib:.2f} GiB, "
                 f"prefill peak {plan.prefill_peak / gib:.2f}, decode peak {plan.decode_peak / gib:.2f}, with the "
                 f"optimizer state held {self.device_total / gib:.2f} GiB per device: "
                 + ("fits" if self.fits else "does NOT fit")]
        if self.reference:
            lines.append(f"the KL's reference policy (rl.beta > 0, full fine-tuning): {self.reference / gib:.2f} GiB "
                         "per device of starting weights, held through training and rollouts")
        if self.step_s is not None:
            lines.append(f"GRPO step: rollout est. {self.rollout_s:,.1f} s (prefill {plan.prefill_s:,.1f} s + "
                         f"{plan.new_tokens:,} decode steps x {plan.decode_step_s * 1e3:,.1f} ms) + training est. "
                         f"{self.training_step_s:,.1f} s = est. {self.step_s:,.1f} s (estimates, not measurements)")
        return lines


def plan_rollout(config: Config, target: PlanTarget, training: MemoryPlan, training_step_s: float | None,
                 efficiency: Efficiency = Efficiency()) -> RolloutPlan:
    from jlong.parallel.placement import make_mesh
    from jlong.program.train_program import TrainProgram

    rl = config.rl
    generation = plan_generation(config, target, prompt_tokens=config.train.seq_len - rl.max_new_tokens,
                                 new_tokens=rl.max_new_tokens, batch=rl.prompts_per_step, samples=rl.num_generations,
                                 efficiency=efficiency, search=False)
    reference = 0
    if rl.beta and config.lora is None:
        program = TrainProgram(config, make_mesh(config.mesh, target.devices(config.mesh.size)))
        reference = shard_bytes(program.abstract_params)
    return RolloutPlan(generation, training.optimizer_state, reference, training_step_s)
