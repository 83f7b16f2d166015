"""A mixture of experts whose routing has collapsed: one warning line, once.

`expert_load_max_over_mean` (the busiest expert's (token, expert) pairs over
the mean expert's, in the worst MoE layer) can reach at most
num_experts / experts_per_token, where one expert is among every token's
choices. A run that stays near that ceiling for several steps in a row
trains its other experts on little or nothing.
"""

from __future__ import annotations

NEAR_CEILING = 0.9  # a share of the ceiling that counts as collapsed
STEPS = 5  # steps in a row near the ceiling before the warning


class RoutingWatch:
    def __init__(self, num_experts: int, experts_per_token: int, aux_loss_coef: float, aux_loss_trained: bool):
        self.ceiling = num_experts / experts_per_token
        self.experts, self.per_token = num_experts, experts_per_token
        self.coef, self.trained = aux_loss_coef, aux_loss_trained
        self.streak, self.warned = 0, False

    def observe(self, step: int, metrics: dict) -> str | None:
        """The warning line, the first time `metrics` (step `step`'s) ends a run of STEPS steps near the ceiling."""
        load = metrics.get("expert_load_max_over_mean")
        if load is None or self.warned:
            return None
        self.streak = self.streak + 1 if load >= NEAR_CEILING * self.ceiling else 0
        if self.streak < STEPS:
            return None
        self.warned = True
        fix = (f"raise model.router_aux_loss_coef (now {self.coef:g}) or lower train.lr" if self.trained
               else "train the load-balancing loss: train.router_aux_loss=true")
        return (f"warning: routing has collapsed: at steps {step - STEPS + 1}-{step} the busiest expert took "
                f"{load:.2f}x the mean expert's tokens, near the most there is ({self.experts} experts / "
                f"{self.per_token} per token = {self.ceiling:g}: one expert in every token's choices); {fix}")
