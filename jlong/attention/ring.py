"""Causal attention as a ring of flash steps (`jlong.attention.step`).

Each of the R devices of the ring holds one chunk of the sequence in the
zigzag layout (`jlong.ops.zigzag`): ring rank r holds sequence chunks r
(A, early) and 2R-1-r (B, late), each of h tokens, as [B, 2h, heads, d].
The keys and values travel around the ring with `ppermute`; at each of the R
steps a device attends its queries to the chunk it holds, and the partial
results merge by their log-sum-exp. Every step is a fixed set of windows of
the step kernel, over tiles of at most `window` tokens of each half chunk:

- its own chunk: every tile over itself causal and over each earlier tile
  unmasked (A's tiles, then B's, are in sequence order);
- a chunk from a lower rank s < r: every query tile over the tiles of its
  early half, unmasked (chunk s precedes both of this rank's chunks, chunk
  2R-1-s follows both);
- from a higher rank s > r: B's tiles over all its tiles, unmasked (both
  precede chunk 2R-1-r, both follow chunk r).

Local attention (R = 1) is one causal window over the whole sequence (with
a sliding window's `Band`, if the layer has one; a ring with a sliding
window is `jlong.attention.sliding`'s).

With attention sinks (`jlong.attention.sinks`) the merged output and
log-sum-exp take the sinks once, at the end of the forward pass; what is
saved and what the backward pass hands the steps are the sink softmax's.

The custom VJP saves only the device's own chunk (q, k, v, the merged
output and log-sum-exp): the backward pass sends the keys and values around
the ring again, with their gradients travelling along and arriving home
after R hops. The travelling gradients are in the keys' dtype, as every
activation gradient between layers is (bf16 at scale: half the bytes held
and sent), each window's part added in float32 and rounded once. The
queries' gradient stays home and sums in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name

from jlong.attention.blockwise import while_range
from jlong.attention.sinks import add_sinks, sink_logits_gradient, sinks_like
from jlong.attention.step import MASKED, Band, Documents, StepKernel

# Names of the saved output and log-sum-exp, for remat policies that keep
# them (and so skip re-running the attention forward).
ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"

# Tokens per side of one kernel call on a ring: each call's inputs are copied
# out of the chunk and its outputs and workspace are whole arrays, so at
# millions of tokens per chunk they must come in pieces.
RING_WINDOW = 2**20


def ring_attention(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, *, kernel: StepKernel, axis: str | None, size: int,
                   window: int = RING_WINDOW, band: Band | None = None, sink_logits_H=None):
    """Causal attention of this device's queries over the whole ring's keys
    and values (`axis` None and `size` 1: local attention, within `band` if
    given), with the sink logits [H] of q's heads if given. On a ring, no
    kernel call covers more than `window` queries or keys."""
    if band is not None and size > 1:
        raise ValueError("a sliding window on a ring is jlong.attention.sliding's")
    sinks = sinks_like(sink_logits_H, q_BsHd)
    return _ring(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, sinks, kernel, axis, size, window, band)


def _next_on_ring(x, axis, size):
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])


def _source_is_lower(step, axis, size):
    """Whether the chunk held at ring step `step` comes from a lower rank."""
    rank = jax.lax.axis_index(axis)
    return (rank - step) % size < rank


def _tiles(length: int, window: int) -> tuple[int, int]:
    """(tiles per zigzag chunk, tokens per tile): the fewest equal tiles of
    half of this device's chunk with no more than `window` tokens each."""
    h = length // 2
    count = -(-h // window)
    while h % count:
        count += 1
    return count, h // count


def _own_windows(length: int, window: int):
    """The windows (query start, key start, tokens, causal) of a device's own
    chunk on a ring: its tiles in layout order (A's, then B's, in sequence
    order too), each over itself causal and over every earlier tile unmasked."""
    m, n = _tiles(length, window)
    return [(i * n, j * n, n, i == j) for i in range(2 * m) for j in range(i + 1)]


def _arriving_windows(length: int, window: int, step, axis, size):
    """The unmasked windows of a chunk arriving at ring step `step`: from a
    lower rank s, every query tile over the tiles of its early half (chunk s
    precedes both of this rank's chunks, chunk 2R-1-s follows both); from a
    higher rank, B's tiles over all of its tiles (both its chunks precede
    chunk 2R-1-r and follow chunk r). Both are 2m^2 windows with traced
    starts, so one program serves both cases."""
    m, n = _tiles(length, window)
    lower = _source_is_lower(step, axis, size)
    return [(jnp.where(lower, w // m, m + w // (2 * m)) * n, jnp.where(lower, w % m, w % (2 * m)) * n, n, False)
            for w in range(2 * m * m)]


def _part(x, start, length: int, axis: int = 1):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, start, length, axis=axis)


def _docs(segments_Bs, k_segments_Bs, q_start, k_start, length):
    if segments_Bs is None:
        return None
    return Documents(_part(segments_Bs, q_start, length), _part(k_segments_Bs, k_start, length))


def _attend_windows(kernel, q, segments, windows, o_BsHd, lse_BHs, k, v, k_segments):
    """Merges each window's partial softmax into the running output and
    log-sum-exp over its queries, in place and in float32, one window after
    another (see `_add_window_gradients`)."""
    for i, (q0, k0, n, causal) in enumerate(windows):
        if i:
            o_BsHd, lse_BHs, k, v = jax.lax.optimization_barrier((o_BsHd, lse_BHs, k, v))
        o_step, lse_step = kernel.forward(_part(q, q0, n), _part(k, k0, n), _part(v, k0, n),
                                          _docs(segments, k_segments, q0, k0, n), causal)
        o_part, lse_part = _merge(_part(o_BsHd, q0, n), _part(lse_BHs, q0, n, axis=2), o_step, lse_step)
        o_BsHd = jax.lax.dynamic_update_slice_in_dim(o_BsHd, o_part, q0, axis=1)
        lse_BHs = jax.lax.dynamic_update_slice_in_dim(lse_BHs, lse_part, q0, axis=2)
    return o_BsHd, lse_BHs


def _empty_softmax(q, v):
    """The float32 output (of v's head size) and log-sum-exp of queries that have seen no key yet."""
    B, s, H, _ = q.shape
    return jnp.zeros_like(q, jnp.float32, (B, s, H, v.shape[-1])), jnp.full_like(q, MASKED, jnp.float32, (B, H, s))


def _saved_output(q, o_BsHd, lse_BHs, sinks=None):
    """The output in q's dtype and the log-sum-exp, with the sinks (if any) taken in, named for remat policies."""
    o_BsHd, lse_BHs = add_sinks(o_BsHd, lse_BHs, sinks)
    return checkpoint_name(o_BsHd.astype(q.dtype), ATTENTION_OUT), checkpoint_name(lse_BHs, ATTENTION_LSE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring(q, k, v, segments, sinks, kernel, axis, size, window, band):
    return _ring_forward(q, k, v, segments, sinks, kernel, axis, size, window, band)[0]


def _ring_forward(q, k, v, segments, sinks, kernel, axis, size, window, band):
    length = q.shape[1]
    attend = functools.partial(_attend_windows, kernel, q, segments)

    def step(t, carry):
        o_BsHd, lse_BHs, kv = carry
        kv = _next_on_ring(kv, axis, size)
        return (*attend(_arriving_windows(length, window, t, axis, size), o_BsHd, lse_BHs, *kv), kv)

    if size == 1:  # local attention: the kernel's own output, with no float32 accumulator
        o_BsHd, lse_BHs = kernel.forward(q, k, v, _docs(segments, segments, 0, 0, length), True, band)
    else:
        o_BsHd, lse_BHs = attend(_own_windows(length, window), *_empty_softmax(q, v), k, v, segments)
        o_BsHd, lse_BHs, _ = while_range(1, size, step, (o_BsHd, lse_BHs, (k, v, segments)))
    o_BsHd, lse_BHs = _saved_output(q, o_BsHd, lse_BHs, sinks)
    return o_BsHd, (q, k, v, segments, sinks, o_BsHd, lse_BHs)


def _merge(o_BsHd, lse_BHs, o_step, lse_step):
    """Two partial softmaxes merged by their log-sum-exp, in float32."""
    lse_new = jnp.logaddexp(lse_BHs, lse_step)
    scale_old, scale_step = (_per_query(jnp.exp(x - lse_new)) for x in (lse_BHs, lse_step))
    return o_BsHd * scale_old + o_step.astype(jnp.float32) * scale_step, lse_new


def _add_window_gradients(kernel, saved, windows, dq, k, v, k_segments, dk, dv):
    """Adds each window's gradients in place: dq (of the device's own queries)
    in float32, dk and dv into the sums of the keys' chunk. The windows run
    one after another: a barrier keeps the next window's inputs (copied out
    of their chunks for the kernel) from being made while the last one's
    gradients still live. `saved` is (q, segments, o, lse, do)."""
    q_, segments, o_, lse_, do_ = saved
    for i, (q0, k0, n, causal) in enumerate(windows):
        if i:
            dq, dk, dv, k, v, q_, o_, lse_, do_ = jax.lax.optimization_barrier((dq, dk, dv, k, v, q_, o_, lse_, do_))
        dq_step, dk_step, dv_step = kernel.backward(
            _part(q_, q0, n), _part(k, k0, n), _part(v, k0, n), _docs(segments, k_segments, q0, k0, n), causal,
            _part(o_, q0, n), _part(lse_, q0, n, axis=2), _part(do_, q0, n))
        dq = _add_into(dq, dq_step, q0)
        dk, dv = _add_into(dk, dk_step, k0), _add_into(dv, dv_step, k0)
    return dq, k, v, dk, dv  # k and v as the barriers passed them on


def _ring_backward(kernel, axis, size, window, band, residuals, do_BsHd):
    q, k, v, segments, sinks, o_BsHd, lse_BHs = residuals
    d_sinks = sink_logits_gradient(o_BsHd, lse_BHs, do_BsHd, sinks)
    length = q.shape[1]
    add_gradients = functools.partial(_add_window_gradients, kernel, (q, segments, o_BsHd, lse_BHs, do_BsHd))

    def step(t, carry):
        dq, (k, v, k_segments, dk, dv) = carry
        dq, k, v, dk, dv = add_gradients(_arriving_windows(length, window, t, axis, size), dq, k, v, k_segments,
                                         dk, dv)
        # After the last step's hop every chunk's keys, values and summed gradients are home.
        return dq, _next_on_ring((k, v, k_segments, dk, dv), axis, size)

    if size == 1:  # local attention: the kernel's own gradients, with no float32 sums
        dq, dk, dv = kernel.backward(q, k, v, _docs(segments, segments, 0, 0, length), True, o_BsHd, lse_BHs,
                                     do_BsHd, band)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks
    dq, k_, v_, dk, dv = add_gradients(_own_windows(length, window), jnp.zeros_like(q, jnp.float32), k, v, segments,
                                       jnp.zeros_like(k), jnp.zeros_like(v))
    travelling = _next_on_ring((k_, v_, segments, dk, dv), axis, size)
    dq, (_, _, _, dk, dv) = while_range(1, size, step, (dq, travelling))
    return dq.astype(q.dtype), dk, dv.astype(v.dtype), None, d_sinks


_ring.defvjp(_ring_forward, _ring_backward)


def _add_into(total, part, start):
    """total[:, start:start + len(part)] += part, summed in float32 and kept in total's dtype."""
    window = jax.lax.dynamic_slice_in_dim(total, start, part.shape[1], axis=1)
    summed = (window.astype(jnp.float32) + part.astype(jnp.float32)).astype(total.dtype)
    return jax.lax.dynamic_update_slice_in_dim(total, summed, start, axis=1)


def _per_query(x_BHs):
    """[B, H, s] -> [B, s, H, 1], to scale outputs [B, s, H, d]."""
    return rearrange(x_BHs, "b h s -> b s h")[..., None]


def gathered_attention(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, *, kernel: StepKernel, axis: str,
                       size: int, window: int = RING_WINDOW, sink_logits_H=None):
    """Causal attention of this device's queries over every rank's keys and
    values gathered at hand: k, v [B, R*s, K, d] (and the keys' segment ids
    [B, R*s]) in rank order, as `all_gather` lays them out, each rank's
    chunk zigzag like the ring's. The ring's windows, with each rank's chunk
    sliced out of the gathered keys instead of passed around; the gradients
    of the gathered keys and values come back whole, for `all_gather`'s
    transpose to return each rank its part. With the sink logits [H] of
    q's heads if given."""
    sinks = sinks_like(sink_logits_H, q_BsHd)
    return _gathered(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, sinks, kernel, axis, size, window)


def _chunk_of(x, t, axis, size, length):
    """The chunk of rank (this rank - t) mod R, the one a ring holds at step t (None stays None)."""
    rank = jax.lax.axis_index(axis)
    return _part(x, (rank - t) % size * length, length)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _gathered(q, k_all, v_all, segments, k_segments_all, sinks, kernel, axis, size, window):
    return _gathered_forward(q, k_all, v_all, segments, k_segments_all, sinks, kernel, axis, size, window)[0]


def _gathered_forward(q, k_all, v_all, segments, k_segments_all, sinks, kernel, axis, size, window):
    length = q.shape[1]
    attend = functools.partial(_attend_windows, kernel, q, segments)
    at = functools.partial(_chunk_of, axis=axis, size=size, length=length)

    def step(t, carry):
        windows = _arriving_windows(length, window, t, axis, size)
        return attend(windows, *carry, at(k_all, t), at(v_all, t), at(k_segments_all, t))

    o_BsHd, lse_BHs = attend(_own_windows(length, window), *_empty_softmax(q, v_all), at(k_all, 0), at(v_all, 0),
                             segments)
    o_BsHd, lse_BHs = _saved_output(q, *while_range(1, size, step, (o_BsHd, lse_BHs)), sinks)
    return o_BsHd, (q, k_all, v_all, segments, k_segments_all, sinks, o_BsHd, lse_BHs)


def _gathered_backward(kernel, axis, size, window, residuals, do_BsHd):
    q, k_all, v_all, segments, k_segments_all, sinks, o_BsHd, lse_BHs = residuals
    length = q.shape[1]
    add_gradients = functools.partial(_add_window_gradients, kernel, (q, segments, o_BsHd, lse_BHs, do_BsHd))
    at = functools.partial(_chunk_of, axis=axis, size=size, length=length)

    def add_chunk(windows, t, dq, dk_all, dv_all):
        start = (jax.lax.axis_index(axis) - t) % size * length
        dq, _, _, dk, dv = add_gradients(windows, dq, at(k_all, t), at(v_all, t), at(k_segments_all, t),
                                         at(dk_all, t), at(dv_all, t))
        put = functools.partial(jax.lax.dynamic_update_slice_in_dim, start_index=start, axis=1)
        return dq, put(dk_all, dk), put(dv_all, dv)

    def step(t, carry):
        return add_chunk(_arriving_windows(length, window, t, axis, size), t, *carry)

    carry = add_chunk(_own_windows(length, window), 0, jnp.zeros_like(q, jnp.float32), jnp.zeros_like(k_all),
                      jnp.zeros_like(v_all))
    dq, dk_all, dv_all = while_range(1, size, step, carry)
    d_sinks = sink_logits_gradient(o_BsHd, lse_BHs, do_BsHd, sinks)
    return dq.astype(q.dtype), dk_all, dv_all.astype(v_all.dtype), None, None, d_sinks


_gathered.defvjp(_gathered_forward, _gathered_backward)
