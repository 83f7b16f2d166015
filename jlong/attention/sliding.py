"""Sliding-window attention on a ring: each device's own chunk and the halos
of its two neighbours, nothing else.

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


def check_fits(length: int, window: int) -> None:
    """A window must fit in half a device's zigzag chunk (so only the neighbours' halos reach it)."""
    if window > length // 2:
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


def schedule(length: int, window: int, tile: int = RING_WINDOW, *, size: int) -> tuple[list[_Call], int]:
    """The kernel calls of a rank's chunk of `length` tokens in tiles of at
    most `tile` tokens, and where in each half a neighbour's halo starts."""
    h = length // 2
    m, n = _tiles(length, tile)
    calls = []

    def add(q0, k0, distance, causal, source, only_last_rank=False):
        if _band(distance, n, window, causal) is False:
            return
        tokens = n
        if not causal:  # an earlier tile: only the corner within the window's reach
            tokens, k0, distance = _corner(n, k0, distance, window)
        calls.append(_Call(q0, k0, tokens, causal, _band(distance, tokens, window, causal), source, only_last_rank))

    for half in (0, h):  # A, then B: each tile over itself and every earlier tile of its half
        for i in range(m):
            for j in range(i + 1):
                add(half + i * n, half + j * n, (i - j) * n, i == j, OWN)
    if size > 1:
        for i in range(m):  # B over A: chunks R and R-1 on the last rank
            for j in range(m):
                add(h + i * n, j * n, h + (i - j) * n, False, OWN, only_last_rank=True)
    for source, half in ((PREVIOUS, 0), (NEXT, h)):  # over a neighbour's half, keys placed as in that half
        for i in range(m):
            for j in range(m):
                add(half + i * n, j * n, h + (i - j) * n, False, source)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _sliding(q, k, v, segments, sinks, kernel, axis, size, window):  # window: (tokens, tile)
    return _sliding_forward(q, k, v, segments, sinks, kernel, axis, size, window)[0]


def _sliding_forward(q, k, v, segments, sinks, kernel, axis, size, window):
    calls, tail = schedule(q.shape[1], *window, size=size)
    keys = {OWN: (k, v, segments), **_halos(k, v, segments, tail, axis, size)}

    def attend(call, state):
        o_BsHd, lse_BHs = state
        ks, vs, k_segments = keys[call.source]
        q0, k0, n = call.q0, call.k0, call.n
        o_step, lse_step = kernel.forward(_part(q, q0, n), _part(ks, k0, n), _part(vs, k0, n),
                                          _docs(segments, k_segments, q0, k0, n), call.causal, call.band)
        o_part, lse_part = _merge(_part(o_BsHd, q0, n), _part(lse_BHs, q0, n, axis=2), o_step, lse_step)
        return (jax.lax.dynamic_update_slice_in_dim(o_BsHd, o_part, q0, axis=1),
                jax.lax.dynamic_update_slice_in_dim(lse_BHs, lse_part, q0, axis=2))

    state = _empty_softmax(q)
    for call in calls:
        state = _when(_runs_here(call, axis, size), functools.partial(attend, call), state)
    o_BsHd, lse_BHs = _saved_output(q, *state, sinks)
    return o_BsHd, (q, k, v, segments, sinks, o_BsHd, lse_BHs)


def _sliding_backward(kernel, axis, size, window, residuals, do_BsHd):
    q, k, v, segments, sinks, o_BsHd, lse_BHs = residuals
    calls, tail = schedule(q.shape[1], *window, size=size)
    halos = _halos(k, v, segments, tail, axis, size)
    keys = {OWN: (k, v, segments), **halos}

    def add_gradients(call, state):
        dq, dkv = state
        ks, vs, k_segments = keys[call.source]
        q0, k0, n = call.q0, call.k0, call.n
        dq_step, dk_step, dv_step = kernel.backward(
            _part(q, q0, n), _part(ks, k0, n), _part(vs, k0, n), _docs(segments, k_segments, q0, k0, n), call.causal,
            _part(o_BsHd, q0, n), _part(lse_BHs, q0, n, axis=2), _part(do_BsHd, q0, n), call.band)
        dk, dv = dkv[call.source]
        dkv = {**dkv, call.source: (_add_into(dk, dk_step, k0), _add_into(dv, dv_step, k0))}
        return _add_into(dq, dq_step, q0), dkv

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
