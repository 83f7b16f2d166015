"""Attention sinks (GPT-OSS): one learned logit s_h per query head that
joins every query's softmax denominator and carries no value.

Given the output o and log-sum-exp lse of a flash forward over every key a
query sees (after a ring's merge), the sink's softmax is

    lse' = logaddexp(lse, s),   o' = o * exp(lse - lse') = o * sigmoid(lse - s).

Handed (o', lse'), the unchanged flash backward gives the sink softmax's
dq, dk, dv exactly: its probabilities exp(score - lse') and its correction
rowsum(do * o') are the sink softmax's own. The sink's gradient is

    ds_h = -sum over queries of exp(s_h - lse') * rowsum(do * o').

So each attention path applies `add_sinks` once per query at the end of its
forward pass (never per ring step), saves (o', lse'), and adds
`sink_logits_gradient` in its backward pass. A query that sees no key
(lse = MASKED) gets o' = 0. Everything here is float32.
"""

from __future__ import annotations

import jax.numpy as jnp
from einops import rearrange

from jlong.ops.tiling import varying_like


def add_sinks(o_BsHd, lse_BHs, sink_logits_H):
    """(o', lse') in float32 for a softmax's (o, lse) and its heads' sink
    logits [H]; (o, lse) unchanged without sinks (None)."""
    if sink_logits_H is None:
        return o_BsHd, lse_BHs
    s_1H1 = sink_logits_H.astype(jnp.float32)[None, :, None]
    lse_BHs = lse_BHs.astype(jnp.float32)
    with_sink_BHs = jnp.logaddexp(lse_BHs, s_1H1)
    keep_BsH1 = rearrange(jnp.exp(lse_BHs - with_sink_BHs), "b h s -> b s h")[..., None]
    return o_BsHd.astype(jnp.float32) * keep_BsH1, with_sink_BHs


def sink_logits_gradient(o_BsHd, lse_BHs, do_BsHd, sink_logits_H):
    """The sink logits' gradient [H] from the sink softmax's (o', lse') and
    the output's gradient, summed over this device's queries, in the logits'
    dtype (None without sinks)."""
    if sink_logits_H is None:
        return None
    delta_BsH = jnp.sum(do_BsHd.astype(jnp.float32) * o_BsHd.astype(jnp.float32), axis=-1)
    weight_BHs = jnp.exp(sink_logits_H.astype(jnp.float32)[None, :, None] - lse_BHs)
    return (-jnp.einsum("bhs,bsh->h", weight_BHs, delta_BsH)).astype(sink_logits_H.dtype)


def sinks_like(sink_logits_H, q_BsHd):
    """The sink logits as a custom VJP of q's device may take them: float32,
    and varying over q's mesh axes inside shard_map, so each device's
    backward pass returns its own part of their gradient and the transpose
    of the mark sums the parts (None stays None)."""
    if sink_logits_H is None:
        return None
    if sink_logits_H.shape != (q_BsHd.shape[2],):
        raise ValueError(f"sink logits {sink_logits_H.shape} for queries of {q_BsHd.shape[2]} heads")
    return varying_like(sink_logits_H.astype(jnp.float32), q_BsHd)
