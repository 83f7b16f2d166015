"""Token-choice routing: a linear router scores every expert for each
token (plus a bias per expert in GPT-OSS), and each token goes to its
`top_k` highest-scoring experts. Their weights are, as Qwen3-MoE and
Qwen3.5-MoE weigh them, the experts' probabilities under a softmax over all
experts in float32 (renormalised to sum to one when the model says so), or,
as GPT-OSS weighs them, a softmax over the k chosen scores alone
(`softmax_after_top_k`). The statistics below take the softmax over all
experts either way, as transformers' load-balancing loss does.

A token's k choices are k (token, expert) pairs; `group_by_expert` sorts the
pairs by expert (stably, so a group keeps its tokens in order) and counts
each group, which is what a grouped matmul takes.

Each MoE layer also reports its routing over the whole batch, its
statistics (a dict of `EXPERT_TOKENS`, `EXPERT_PROBABILITIES`,
`ROUTED_TOKENS`): the pairs each expert received, the sum of each expert's
probabilities, and the tokens routed. Two things are computed from every
layer's: the load-balancing loss (Switch Transformer's, arXiv 2101.03961:
in each MoE layer, each expert's share of the pairs times its mean
probability, summed and multiplied by the number of experts; averaged over
the layers), and `expert_load_max_over_mean`, the busiest expert's pairs
over the mean, in the worst layer (1.0 is a perfect balance).

The loss is taken per layer, as the Switch Transformer defines it, where
transformers (`load_balancing_loss_func` of these models) pools every
layer's pairs and probabilities before the product. Pooled, layers that
overload complementary experts cancel: a tiny Qwen3-MoE (2 layers, 8
experts, 2 per token) trained 60 steps on bytes ended with the pooled loss
at its balanced value (top_k) while its first layer sent 1.8-2x the mean
to three experts and about 0.2x to two others, and its second layer the
reverse; transformers' own model, trained the same way in torch, ended at
2.3x in its worst layer, and at 1.4x with the loss taken per layer. For
one MoE layer the two are equal, and both are top_k when every layer is
balanced, so `router_aux_loss_coef` keeps its meaning.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EXPERT_TOKENS = "expert_tokens"  # [E] (token, expert) pairs each expert received
EXPERT_PROBABILITIES = "expert_probabilities"  # [E] the sum over tokens of each expert's router probability
ROUTED_TOKENS = "routed_tokens"  # [] tokens routed


def route(h_TD, router_DE, *, top_k: int, normalize: bool, bias_E=None, softmax_after_top_k: bool = False):
    """(probabilities [T, E] float32, weights [T, k] float32, experts [T, k] int32)
    of tokens h [T, D] under the router's weights [D, E] (and its bias [E], added in float32)."""
    logits_TE = jnp.einsum("td,de->te", h_TD, router_DE).astype(jnp.float32)
    if bias_E is not None:
        logits_TE = logits_TE + bias_E.astype(jnp.float32)
    probabilities_TE = jax.nn.softmax(logits_TE, axis=-1)
    if softmax_after_top_k:
        chosen_Tk, experts_Tk = jax.lax.top_k(logits_TE, top_k)
        return probabilities_TE, jax.nn.softmax(chosen_Tk, axis=-1), experts_Tk
    weights_Tk, experts_Tk = jax.lax.top_k(probabilities_TE, top_k)
    if normalize:
        weights_Tk = weights_Tk / jnp.sum(weights_Tk, axis=-1, keepdims=True)
    return probabilities_TE, weights_Tk, experts_Tk


def group_by_expert(experts_Tk, num_experts: int):
    """(order [T*k], group sizes [E] int32): the (token, expert) pairs, pair p
    being token p // k's (p % k)-th choice, sorted by expert, and how many
    pairs each expert has."""
    experts_P = experts_Tk.reshape(-1)
    order_P = jnp.argsort(experts_P, stable=True)
    group_sizes_E = jnp.zeros((num_experts,), jnp.int32).at[experts_P].add(1)
    return order_P, group_sizes_E


def no_statistics(num_experts: int) -> dict:
    """Routing statistics of no tokens: what sums start from."""
    zeros_E = jnp.zeros((num_experts,), jnp.float32)
    return {EXPERT_TOKENS: zeros_E, EXPERT_PROBABILITIES: zeros_E, ROUTED_TOKENS: jnp.zeros((), jnp.float32)}


def tile_statistics(probabilities_TE, experts_Tk) -> dict:
    """One tile's routing statistics: pairs per expert, probability sums, tokens."""
    num_experts = probabilities_TE.shape[-1]
    pairs_E = jnp.zeros((num_experts,), jnp.float32).at[experts_Tk.reshape(-1)].add(1.0)
    return {EXPERT_TOKENS: pairs_E, EXPERT_PROBABILITIES: jnp.sum(probabilities_TE, axis=0),
            ROUTED_TOKENS: jnp.asarray(probabilities_TE.shape[0], jnp.float32)}


def load_balancing_loss(statistics: dict) -> jax.Array:
    """Switch Transformer's auxiliary loss of each MoE layer, averaged over the
    layers (each entry of `statistics` is [layers, ...]): E x sum_e f_e P_e,
    where f_e is the share of the layer's tokens whose top-k include expert e
    and P_e its mean probability there: top_k when every layer is balanced."""
    rows_L1 = statistics[ROUTED_TOKENS][:, None]
    fraction_LE = statistics[EXPERT_TOKENS] / rows_L1
    probability_LE = statistics[EXPERT_PROBABILITIES] / rows_L1
    return fraction_LE.shape[-1] * jnp.mean(jnp.sum(fraction_LE * probability_LE, axis=-1))


def expert_load_max_over_mean(statistics: dict) -> jax.Array:
    """The busiest expert's pairs over the mean expert's, in the MoE layer where that is largest."""
    tokens_LE = statistics[EXPERT_TOKENS]
    return jnp.max(jnp.max(tokens_LE, axis=-1) / jnp.mean(tokens_LE, axis=-1))
