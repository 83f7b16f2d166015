"""Sliding-window attention on a ring: each device's own chunk and the halos
of its two neighbours, nothing else; and over keys gathered at hand.

A ring rank r holds zigzag chunks r (A, early) and 2R-1-r (B, late), h
tokens each (`jlong.attention.ring`). When the window w is at most h, a
query sees keys of its own chunk and of the chunk just before it, and no
other: chunk r-1 is rank r-1's A, chunk 2R-2-r is rank r+1's B (and for the
last rank, whose chunks R-1 and R are adjacent, its own A). So instead of
R - 1 ring steps, each rank receives two halos, one hop each: the tail of
rank r-1's A and the tail of rank r+1's B, only the w - 1 keys within a
window's reach of the chunk's start. Rank 0 has no chunk before its A and
the last rank none beyond its neighbours, so those windows are skipped at
run time (`lax.cond`); every other kernel call a full ring would make is
never built.

Each window is one step-kernel call over tiles of n tokens (as the ring
tiles its chunks): a tile over itself is causal within the band; a tile
over an earlier tile reaches only the corner of its first queries and that
tile's last keys, so its call covers that corner alone (w - 1 tokens a side
for the tile just before), unmasked within the band at their distance;
tiles wholly out of reach are left out. The backward pass sends each halo's
key and value gradients back to the rank they came from.

The all-gather method (`jlong.attention.methods.allgather`) holds every
rank's keys at hand instead, so its window may be of any length: each half
of a device's chunk attends over itself and over each earlier half chunk
of the sequence the window reaches, the same tile calls at their distance
(`sliding_gathered_attention`); a half chunk that would precede the
sequence's start is skipped at run time.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jlong.attention.ring import RING_WINDOW, _add_into, _docs, _empty_softmax, _merge, _part, _saved_output, _tiles
from jlong.attention.sinks import sink_logits_gradient, sinks_like
from jlong.attention.step import Band, StepKernel
from jlong.errors import JlongError

OWN, PREVIOUS, NEXT = "own", "previous", "next"  # where a call's keys are: the chunk, or a neighbour's halo


class _Call(NamedTuple):
    q0: int  # the call's first query in the device's chunk
    k0: int  # its first key in the key source
    n: int  # tokens on each side
    causal: bool
    band: Band | None  # None: every key is within the window
    source: str  # OWN, PREVIOUS (rank r-1's A tail) or NEXT (rank r+1's B tail)
    only_last_rank: bool = False  # B over A: adjacent only on the last rank


def fits_halos(length: int, window: int) -> bool:
    """Whether a window fits in half of a device's zigzag chunk of `length` tokens, so that only the
    neighbours' halos reach it."""
    return window <= length // 2


def check_fits(length: int, window: int) -> None:
    """A window must fit in half a device's zigzag chunk (so only the neighbours' halos reach it)."""
    if not fits_halos(length, window):
        raise JlongError(f"a sliding window of {window} tokens is longer than half a ring chunk ({length // 2} tokens): "
                         "use a longer sequence or a smaller ring")


def _band(distance: int, n: int, window: int, causal: bool) -> Band | None | bool:
    """The band of a call at `distance` (its first query after its first key):
    False when no query reaches any key, None when every key is in reach."""
    band = Band(window, distance)
    if band.sees_nothing(n):
        return False
    if not causal and distance + n - 1 < window:
        return None
    return band


def _half_calls(q_half: int, k_half: int, back: int, tiles: tuple[int, int], window: int, source: str = OWN,
                only_last_rank: bool = False) -> list[_Call]:
    """The calls of the m tiles of n queries of a half chunk (from `q_half` on) over the half chunk `back` half
    chunks before it in the sequence (its keys from `k_half` on in their source): over its own half (`back` 0)
    each tile over itself, causal, and over each earlier tile; over an earlier half every pair of tiles. Tiles
    out of the window's reach are left out; a tile over an earlier tile covers only the corner in reach."""
    m, n = tiles
    calls = []
    for i in range(m):
        for j in range(i + 1 if back == 0 else m):
            causal, k0, distance, tokens = back == 0 and i == j, k_half + j * n, back * m * n + (i - j) * n, n
            if _band(distance, n, window, causal) is False:
                continue
            if not causal:
                tokens, k0, distance = _corner(n, k0, distance, window)
            calls.append(_Call(q_half + i * n, k0, tokens, causal, _band(distance, tokens, window, causal), source,
                               only_last_rank))
    return calls


def schedule(length: int, window: int, tile: int = RING_WINDOW, *, size: int) -> tuple[list[_Call], int]:
    """The kernel calls of a rank's chunk of `length` tokens in tiles of at
    most `tile` tokens, and where in each half a neighbour's halo starts."""
    h = length // 2
    tiles = _tiles(length, tile)
    calls = _half_calls(0, 0, 0, tiles, window) + _half_calls(h, h, 0, tiles, window)  # A, then B, over themselves
    if size > 1:  # B over A: chunks R and R-1 on the last rank
        calls += _half_calls(h, 0, 1, tiles, window, only_last_rank=True)
    for source, half in ((PREVIOUS, 0), (NEXT, h)):  # over a neighbour's half, keys placed as in that half
        calls += _half_calls(half, 0, 1, tiles, window, source)
    tail = min((call.k0 for call in calls if call.source != OWN), default=h)  # a halo: a half's keys from here on
    return [call if call.source == OWN else call._replace(k0=call.k0 - tail) for call in calls], tail


def _corner(n: int, k0: int, distance: int, window: int) -> tuple[int, int, int]:
    """A call of n queries over n earlier keys (`distance` >= n) within a
    window reaches only the e x e corner of its first queries and last keys,
    e = n + window - 1 - distance (n at most): (e, that corner's first key,
    its distance)."""
    e = min(n, n + window - 1 - distance)
    return e, k0 + n - e, distance - (n - e)


def sliding_ring_attention(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, *, kernel: StepKernel, axis: str, size: int,
                           window: int, tile: int = RING_WINDOW, sink_logits_H=None):
    """Causal attention within a sliding window of `window` tokens of this
    device's queries over the ring's keys and values (zigzag, as
    `jlong.attention.ring.ring_attention` takes them), with the sink logits
    [H] of q's heads if given; no kernel call covers more than `tile`
    queries or keys."""
    check_fits(q_BsHd.shape[1], window)
    sinks = sinks_like(sink_logits_H, q_BsHd)
    return _sliding(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, sinks, kernel, axis, size, (window, tile))


def _from_lower(x, axis, size):
    """Each rank's x from the rank below it (rank 0 gets zeros)."""
    return jax.lax.ppermute(x, axis, [(i, i + 1) for i in range(size - 1)])


def _from_higher(x, axis, size):
    return jax.lax.ppermute(x, axis, [(i + 1, i) for i in range(size - 1)])


def _halos(k, v, segments, tail: int, axis, size):
    """{PREVIOUS: rank r-1's A tail, NEXT: rank r+1's B tail}, each (k, v,
    segment ids); none when a tail is empty."""
    h = k.shape[1] // 2
    if tail == h:
        return {}

    def tail_of(x, half):
        return None if x is None else x[:, half + tail:half + h]

    return {
        PREVIOUS: _from_lower(tuple(tail_of(x, 0) for x in (k, v, segments)), axis, size),
        NEXT: _from_higher(tuple(tail_of(x, h) for x in (k, v, segments)), axis, size),
    }


def _runs_here(call: _Call, axis, size):
    """Whether this rank runs `call` (None: every rank does)."""
    rank = jax.lax.axis_index(axis)
    if call.only_last_rank:
        return rank == size - 1
    if call.source == PREVIOUS:
        return rank > 0
    if call.source == NEXT:
        return rank < size - 1
    return None


def _when(predicate, run, state):
    return run(state) if predicate is None else jax.lax.cond(predicate, run, lambda s: s, state)


def _attend(kernel, q, segments, call: _Call, keys, k0, state):
    """The running output and log-sum-exp (`state`) of q with one call's partial softmax merged in: its
    queries over `keys` (k, v and their segment ids) from k0 on."""
    o_BsHd, lse_BHs = state
    ks, vs, k_segments = keys
    q0, n = call.q0, call.n
    o_step, lse_step = kernel.forward(_part(q, q0, n), _part(ks, k0, n), _part(vs, k0, n),
                                      _docs(segments, k_segments, q0, k0, n), call.causal, call.band)
    o_part, lse_part = _merge(_part(o_BsHd, q0, n), _part(lse_BHs, q0, n, axis=2), o_step, lse_step)
    return (jax.lax.dynamic_update_slice_in_dim(o_BsHd, o_part, q0, axis=1),
            jax.lax.dynamic_update_slice_in_dim(lse_BHs, lse_part, q0, axis=2))


def _add_gradients(kernel, saved, call: _Call, keys, k0, state):
    """(dq, dk, dv) with one call's gradients added in; `saved` is (q, segments, o, lse, do) and dk, dv are
    the gradients of `keys` (k, v and their segment ids), the call's from k0 on."""
    q, segments, o_BsHd, lse_BHs, do_BsHd = saved
    dq, dk, dv = state
    ks, vs, k_segments = keys
    q0, n = call.q0, call.n
    dq_step, dk_step, dv_step = kernel.backward(
        _part(q, q0, n), _part(ks, k0, n), _part(vs, k0, n), _docs(segments, k_segments, q0, k0, n), call.causal,
        _part(o_BsHd, q0, n), _part(lse_BHs, q0, n, axis=2), _part(do_BsHd, q0, n), call.band)
    return _add_into(dq, dq_step, q0), _add_into(dk, dk_step, k0), _add_into(dv, dv_step, k0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _sliding(q, k, v, segments, sinks, kernel, axis, size, window):  # window: (tokens, tile)
    return _sliding_forward(q, k, v, segments, sinks, kernel, axis, size, window)[0]


def _sliding_forward(q, k, v, segments, sinks, kernel, axis, size, window):
    calls, tail = schedule(q.shape[1], *window, size=size)
    keys = {OWN: (k, v, segments), **_halos(k, v, segments, tail, axis, size)}
    state = _empty_softmax(q, v)
    for call in calls:
        attend = functools.partial(_attend, kernel, q, segments, call, keys[call.source], call.k0)
        state = _when(_runs_here(call, axis, size), attend, state)
    o_BsHd, lse_BHs = _saved_output(q, *state, sinks)
    return o_BsHd, (q, k, v, segments, sinks, o_BsHd, lse_BHs)


def _sliding_backward(kernel, axis, size, window, residuals, do_BsHd):
    q, k, v, segments, sinks, o_BsHd, lse_BHs = residuals
    calls, tail = schedule(q.shape[1], *window, size=size)
    halos = _halos(k, v, segments, tail, axis, size)
    keys = {OWN: (k, v, segments), **halos}
    saved = (q, segments, o_BsHd, lse_BHs, do_BsHd)

    def add_gradients(call, state):
        dq, dkv = state
        dq, dk, dv = _add_gradients(kernel, saved, call, keys[call.source], call.k0, (dq, *dkv[call.source]))
        return dq, {**dkv, call.source: (dk, dv)}

    zeros = {source: (jnp.zeros_like(ks), jnp.zeros_like(vs)) for source, (ks, vs, _) in keys.items()}
    state = (jnp.zeros_like(q, jnp.float32), zeros)
    for call in calls:
        state = _when(_runs_here(call, axis, size), functools.partial(add_gradients, call), state)
    dq, dkv = state
    # Each halo's gradients go home: the A tail's to rank r-1, the B tail's to rank r+1.
    dk, dv = dkv[OWN]
    h = k.shape[1] // 2
    for source, half, home in ((PREVIOUS, 0, _from_higher), (NEXT, h, _from_lower)) if halos else ():
        dk_tail, dv_tail = home(dkv[source], axis, size)
        dk, dv = _add_into(dk, dk_tail, half + tail), _add_into(dv, dv_tail, half + tail)
    return dq.astype(q.dtype), dk, dv.astype(v.dtype), None, sink_logits_gradient(o_BsHd, lse_BHs, do_BsHd, sinks)


_sliding.defvjp(_sliding_forward, _sliding_backward)


# ---------------------------------------------------------------- over keys gathered at hand


def gathered_schedule(length: int, window: int, tile: int = RING_WINDOW, *, size: int) -> list[tuple[int, int, _Call]]:
    """The kernel calls of a rank's chunk of `length` tokens over every rank's keys at hand, for a window of
    any length: each half of the chunk (0: A, 1: B) over itself and over each of the `back` half chunks
    before it in the sequence that the window reaches, as (half, back, call) with the call's keys counted from
    that half chunk's first."""
    h = length // 2
    tiles = _tiles(length, tile)
    reach = min(-(-(window - 1) // h), 2 * size - 1)  # half chunks before a query's own that the window reaches
    return [(half, back, call) for half in (0, 1) for back in range(reach + 1)
            for call in _half_calls(half * h, 0, back, tiles, window)]


def sliding_gathered_attention(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, *, kernel: StepKernel,
                               axis: str, size: int, window: int, tile: int = RING_WINDOW, sink_logits_H=None):
    """Causal attention within a sliding window of `window` tokens (any length) of this device's queries over
    every rank's keys and values gathered at hand (k, v [B, R*s, K, d] and their segment ids, in rank order,
    each rank's chunk zigzag: `jlong.attention.ring.gathered_attention`'s), with the sink logits [H] of q's
    heads if given: the window is a band on the gathered keys, and only the half chunks within its reach are
    visited. The gathered keys' gradients come back whole, for `all_gather`'s transpose to return each rank
    its part. No kernel call covers more than `tile` queries or keys."""
    sinks = sinks_like(sink_logits_H, q_BsHd)
    return _sliding_gathered(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, sinks, kernel, axis, size,
                             (window, tile))


def _gathered_calls(length: int, window, axis, size):
    """Each call of `gathered_schedule`, with where its keys start in the gathered keys (traced) and whether
    this rank runs it (None: every rank; a half chunk before the sequence's first is none)."""
    h = length // 2
    rank = jax.lax.axis_index(axis)
    for half, back, call in gathered_schedule(length, *window, size=size):
        chunk = (rank if half == 0 else 2 * size - 1 - rank) - back  # the keys' chunk in the sequence
        runs = None if back <= (0 if half == 0 else size) else chunk >= 0  # B's chunk is at least R - back
        # Chunk c is rank c's first half for c < R, else rank 2R-1-c's second.
        start = jnp.where(chunk < size, chunk * 2 * h, (2 * size - 1 - chunk) * 2 * h + h)
        yield call, start + call.k0, runs


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _sliding_gathered(q, k_all, v_all, segments, k_segments_all, sinks, kernel, axis, size, window):
    return _sliding_gathered_forward(q, k_all, v_all, segments, k_segments_all, sinks, kernel, axis, size, window)[0]


def _sliding_gathered_forward(q, k_all, v_all, segments, k_segments_all, sinks, kernel, axis, size, window):
    keys = (k_all, v_all, k_segments_all)
    state = _empty_softmax(q, v_all)
    for call, k0, runs in _gathered_calls(q.shape[1], window, axis, size):
        state = _when(runs, functools.partial(_attend, kernel, q, segments, call, keys, k0), state)
    o_BsHd, lse_BHs = _saved_output(q, *state, sinks)
    return o_BsHd, (q, k_all, v_all, segments, k_segments_all, sinks, o_BsHd, lse_BHs)


def _sliding_gathered_backward(kernel, axis, size, window, residuals, do_BsHd):
    q, k_all, v_all, segments, k_segments_all, sinks, o_BsHd, lse_BHs = residuals
    keys, saved = (k_all, v_all, k_segments_all), (q, segments, o_BsHd, lse_BHs, do_BsHd)
    state = (jnp.zeros_like(q, jnp.float32), jnp.zeros_like(k_all), jnp.zeros_like(v_all))
    for call, k0, runs in _gathered_calls(q.shape[1], window, axis, size):
        state = _when(runs, functools.partial(_add_gradients, kernel, saved, call, keys, k0), state)
    dq, dk_all, dv_all = state
    return (dq.astype(q.dtype), dk_all, dv_all, None, None,
            sink_logits_gradient(o_BsHd, lse_BHs, do_BsHd, sinks))


_sliding_gathered.defvjp(_sliding_gathered_forward, _sliding_gathered_backward)
