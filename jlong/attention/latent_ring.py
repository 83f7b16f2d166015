"""Ring attention moving a latent: what travels around the ring is each
chunk's per-token latent (multi-head latent attention's compressed key-value
latent and rotary key, `jlong.attention.latent`), and each device
up-projects every chunk that arrives into the keys and values of its own
heads before the step kernel runs on it (`expand(weights, latent)`).

The windows, the zigzag layout and the merging of partial softmaxes are the
ring's (`jlong.attention.ring`). The custom VJP saves the device's queries,
its own chunk's latent, the up-projection's weights, the merged output and
log-sum-exp. In the backward pass the latent travels again with its gradient
alongside: each arriving chunk's key and value gradients (summed over its
windows) go back through the up-projection at once, so the travelling
gradient is the latent's (per token, not per head), and the weights'
gradient sums at home in float32. As on the ring, a chunk's key
and value gradients are in the keys' dtype, each window's part added in
float32 and rounded once; the latent's gradient travels in the latent's
dtype and arrives home after R hops.

With LoRA the up-projection is an `Adapted` weight (`jlong.ops.adapted`:
the frozen W_kv_b of this device's heads and its adapters a, b), expanded
as x @ w + (x @ a) @ b on every arriving chunk; the backward pass
differentiates a and b alone (their gradients summed at home as any
weight's), never forming the frozen w's, whose cotangent is zero. It is not
merged into w + a @ b before the ring: in bfloat16 that sum would round
the adapters' small update away.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jlong.attention.blockwise import while_range
from jlong.attention.ring import (RING_WINDOW, _add_window_gradients, _arriving_windows, _attend_windows,
                                  _empty_softmax, _next_on_ring, _own_windows, _saved_output)
from jlong.attention.step import StepKernel
from jlong.ops.adapted import Adapted
from jlong.ops.tiling import varying_like


def latent_ring_attention(q_BsHd, latent, weights, expand, segment_ids_Bs, *, kernel: StepKernel, axis: str,
                          size: int, window: int = RING_WINDOW):
    """Causal attention of this device's queries over the whole ring's keys
    and values, made on each device by expand(weights, a chunk's latent) ->
    (k, v) [B, s, H, d] for q's heads; `latent` is a pytree of this
    device's per-token arrays [B, s, ...]. `expand` must be hashable (a
    bound method of a frozen projection)."""
    # Inside shard_map the weights' and the gathered latent's gradients differ by device: marked varying like
    # q, the transposes of the marks sum them.
    latent, weights = varying_like((latent, weights), q_BsHd)
    return _latent_ring(q_BsHd, latent, weights, segment_ids_Bs, expand, kernel, axis, size, window)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _latent_ring(q, latent, weights, segments, expand, kernel, axis, size, window):
    return _latent_ring_forward(q, latent, weights, segments, expand, kernel, axis, size, window)[0]


def _latent_ring_forward(q, latent, weights, segments, expand, kernel, axis, size, window):
    length = q.shape[1]
    attend = functools.partial(_attend_windows, kernel, q, segments)

    def step(t, carry):
        o_BsHd, lse_BHs, travelling = carry
        travelling = _next_on_ring(travelling, axis, size)
        latent_t, segments_t = travelling
        return (*attend(_arriving_windows(length, window, t, axis, size), o_BsHd, lse_BHs,
                        *expand(weights, latent_t), segments_t), travelling)

    k, v = expand(weights, latent)
    o_BsHd, lse_BHs = attend(_own_windows(length, window), *_empty_softmax(q, v), k, v, segments)
    o_BsHd, lse_BHs, _ = while_range(1, size, step, (o_BsHd, lse_BHs, (latent, segments)))
    o_BsHd, lse_BHs = _saved_output(q, o_BsHd, lse_BHs)
    return o_BsHd, (q, latent, weights, segments, o_BsHd, lse_BHs)


def _latent_ring_backward(expand, kernel, axis, size, window, residuals, do_BsHd):
    q, latent, weights, segments, o_BsHd, lse_BHs = residuals
    length = q.shape[1]
    add_gradients = functools.partial(_add_window_gradients, kernel, (q, segments, o_BsHd, lse_BHs, do_BsHd))

    trainable, rebuilt = _trainable(weights)

    def chunk_gradients(windows, dq, latent_t, segments_t):
        """dq with the chunk's windows added, and the chunk's (latent, weights) gradients."""
        (k, v), pullback = jax.vjp(lambda t, latent_t: expand(rebuilt(t), latent_t), trainable, latent_t)
        dq, _, _, dk, dv = add_gradients(windows, dq, k, v, segments_t, jnp.zeros_like(k), jnp.zeros_like(v))
        d_weights, d_latent = pullback((dk, dv))
        return dq, d_latent, d_weights

    def step(t, carry):
        dq, d_weights, (latent_t, segments_t, d_latent_t) = carry
        dq, d_latent, d_weights_t = chunk_gradients(_arriving_windows(length, window, t, axis, size), dq, latent_t,
                                                    segments_t)
        d_latent_t = jax.tree.map(_sum_in_float32, d_latent_t, d_latent)
        d_weights = jax.tree.map(lambda total, part: total + part.astype(jnp.float32), d_weights, d_weights_t)
        # After the last step's hop every chunk's latent and its summed gradient are home.
        return dq, d_weights, _next_on_ring((latent_t, segments_t, d_latent_t), axis, size)

    dq, d_latent, d_weights = chunk_gradients(_own_windows(length, window), jnp.zeros_like(q, jnp.float32), latent,
                                              segments)
    d_weights = jax.tree.map(lambda d: d.astype(jnp.float32), d_weights)
    travelling = _next_on_ring((latent, segments, d_latent), axis, size)
    dq, d_weights, (_, _, d_latent) = while_range(1, size, step, (dq, d_weights, travelling))
    d_weights = jax.tree.map(lambda d, w: d.astype(w.dtype), d_weights, trainable)
    return dq.astype(q.dtype), d_latent, _frozen_zeros(weights, d_weights), None


_latent_ring.defvjp(_latent_ring_forward, _latent_ring_backward)


def _sum_in_float32(total, part):
    return (total.astype(jnp.float32) + part.astype(jnp.float32)).astype(total.dtype)


def _is_adapted(x) -> bool:
    return isinstance(x, Adapted)


def _trainable(weights):
    """(what the backward pass differentiates, rebuilt: it -> weights): the weights, but an `Adapted` weight's
    frozen w is held as it is and only its adapters (a, b) are differentiated."""
    leaves, tree = jax.tree.flatten(weights, is_leaf=_is_adapted)
    trainable = [(x.a, x.b) if _is_adapted(x) else x for x in leaves]

    def rebuilt(parts):
        return jax.tree.unflatten(tree, [dataclasses.replace(x, a=part[0], b=part[1]) if _is_adapted(x) else part
                                         for x, part in zip(leaves, parts)])

    return trainable, rebuilt


def _frozen_zeros(weights, d_trainable):
    """The weights' cotangent from the trainable parts': zero for an `Adapted` weight's frozen w."""
    leaves, tree = jax.tree.flatten(weights, is_leaf=_is_adapted)
    return jax.tree.unflatten(tree, [Adapted(jnp.zeros_like(x.w), *d, x.inputs) if _is_adapted(x) else d
                                     for x, d in zip(leaves, d_trainable)])
