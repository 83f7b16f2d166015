"""DeepSeek's routing (DeepSeek-V2 and V3, GLM-4.7-Flash, Moonlight), as
transformers computes it.

Each expert gets a score: its sigmoid (V3's, with one logit per expert) or
its softmax over all experts (V2's). A token's experts are chosen in two
steps: the experts fall in `groups` equal groups, a group's score being the
sum of its two best scores (V3) or its best (V2), and only the token's
`top_groups` best groups take part; among their experts it takes the
`top_k` best. V3 chooses by the scores plus a correction bias per expert
(`e_score_correction_bias`, kept by the auxiliary-loss-free balancing) that
never weighs anything. The chosen experts are weighed by their scores,
renormalised to sum to one when the model says so, times
`routed_scaling_factor`.

The logits and everything after them are float32, whatever the compute
dtype (transformers keeps the router in float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

SIGMOID, SOFTMAX = "sigmoid", "softmax"
TWO_BEST, BEST = "two_best", "best"  # a group's score: its two best experts' sum (V3), or its best (V2)


@dataclasses.dataclass(frozen=True)
class GroupLimitedRouting:
    scoring: str = SIGMOID  # SIGMOID or SOFTMAX
    groups: int = 1
    top_groups: int = 1
    group_score: str = TWO_BEST  # TWO_BEST or BEST
    scale: float = 1.0  # routed_scaling_factor

    def route(self, h_TD, router_DE, *, top_k: int, normalize: bool, correction_bias_E=None):
        """(probabilities [T, E], weights [T, k], experts [T, k] int32) of tokens h [T, D]. The
        probabilities, for the routing statistics and the load-balancing loss, are the scores
        normalised over the experts (a softmax's already are)."""
        logits_TE = jnp.einsum("td,de->te", h_TD.astype(jnp.float32), router_DE.astype(jnp.float32))
        scores_TE = jax.nn.sigmoid(logits_TE) if self.scoring == SIGMOID else jax.nn.softmax(logits_TE, axis=-1)
        choice_TE = scores_TE if correction_bias_E is None else scores_TE + correction_bias_E.astype(jnp.float32)
        if self.top_groups < self.groups:
            choice_TE = jnp.where(self._in_best_groups(choice_TE), choice_TE, -jnp.inf)
        _, experts_Tk = jax.lax.top_k(choice_TE, top_k)
        weights_Tk = jnp.take_along_axis(scores_TE, experts_Tk, axis=-1)
        if normalize:
            weights_Tk = weights_Tk / (jnp.sum(weights_Tk, axis=-1, keepdims=True) + 1e-20)
        probabilities_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
        return probabilities_TE, weights_Tk * self.scale, experts_Tk

    def _in_best_groups(self, choice_TE):
        """[T, E] whether each expert is in one of the token's `top_groups` best groups."""
        T, E = choice_TE.shape
        grouped_TGn = choice_TE.reshape(T, self.groups, E // self.groups)
        if self.group_score == TWO_BEST:
            group_TG = jnp.sum(jax.lax.top_k(grouped_TGn, 2)[0], axis=-1)
        else:
            group_TG = jnp.max(grouped_TGn, axis=-1)
        _, best_Tg = jax.lax.top_k(group_TG, self.top_groups)
        kept_TG = jnp.any(best_Tg[:, :, None] == jnp.arange(self.groups), axis=1)
        return jnp.repeat(kept_TG, E // self.groups, axis=1)
