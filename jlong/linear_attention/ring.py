"""Linear attention around a ring: the state passed between ring ranks.

On the zigzag layout (`jlong.ops.zigzag`) ring rank r holds two contiguous
pieces of the sequence, chunks r and 2R-1-r of its 2R chunks. A linear
layer's chunk depends on what came before it through two things only:

- its short causal convolution, through the last taps - 1 tokens of the
  chunk before it (`halo`: every rank's chunk tails, all-gathered, are
  small);
- the rule's state, linearly: with the same tokens, a chunk maps the state
  it starts from to the state it ends with as S_out = M S_in + S_0, with M
  [dk, dk] and S_0 [dk, dv] per head (M is 0 past a document start).

`ring_rule` runs each chunk once with the state [I | 0] and values [0 | v],
which gives [M | S_0] in one pass; gathers every chunk's (M, S_0) over the
ring (as LASP-2 gathers its chunk states); walks the 2R chunks in sequence
order to get each chunk's incoming state; and runs its chunks again from
those states for their outputs. The rule's work is about twice the single
device's; what crosses the ring is O(heads x dk x (dk + dv)) per chunk,
whatever the length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlong.ops.zigzag import chunk_order


def _gathered_by_chunk(x, axis: str, size: int):
    """Each rank's two pieces x [2, ...] gathered over the ring, in sequence
    order: [2R, ...] (chunk c of the sequence at index c)."""
    every = jax.lax.all_gather(x, axis).reshape(2 * size, *x.shape[1:])  # rank-major: (r, half)
    return every[np.argsort(chunk_order(size))]


def _own_chunks(axis: str, size: int):
    """The sequence chunks this rank holds: (r, 2R-1-r), traced."""
    r = jax.lax.axis_index(axis)
    return r, 2 * size - 1 - r


def halo(x_B2cNd, segment_ids_B2c, width: int, axis: str, size: int):
    """The `width` tokens before each of this rank's two pieces (x [B, 2, c,
    N, d] in the pieces' layout) and their segment ids ([B, 2, width]; -1
    before the sequence's first token)."""
    x_2BwNd = jnp.moveaxis(x_B2cNd[:, :, -width:], 1, 0)
    seg_2Bw = jnp.moveaxis(segment_ids_B2c[:, :, -width:], 1, 0)
    tails = _gathered_by_chunk(x_2BwNd, axis, size)
    tail_segments = _gathered_by_chunk(seg_2Bw, axis, size)
    # A chunk "-1" before the sequence: zeros of no document.
    tails = jnp.concatenate([jnp.zeros_like(tails[:1]), tails])
    tail_segments = jnp.concatenate([jnp.full_like(tail_segments[:1], -1), tail_segments])
    before = jnp.stack(_own_chunks(axis, size))  # chunk c's predecessor is c - 1, at index c after the padding
    return jnp.moveaxis(tails[before], 0, 1), jnp.moveaxis(tail_segments[before], 0, 1)


def last_tail(x_B2cNd, segment_ids_B2c, width: int, axis: str, size: int):
    """The sequence's last `width` tokens (of its last chunk, held by ring
    rank 0) and their segment ids, the same on every rank: [B, width, N, d], [B, width]."""
    x_2BwNd = jnp.moveaxis(x_B2cNd[:, :, -width:], 1, 0)
    seg_2Bw = jnp.moveaxis(segment_ids_B2c[:, :, -width:], 1, 0)
    return tuple(_gathered_by_chunk(t, axis, size)[-1] for t in (x_2BwNd, seg_2Bw))


def ring_rule(kernel, q, k, v, g, beta, segment_ids, segment_before, *, axis: str, size: int):
    """(the rule's output for this rank's two pieces ([B, 2, c, ...] each), as
    if the whole sequence ran on one device; the state after the sequence's
    last token, the same on every rank). `segment_before` [B, 2] is the segment of the
    token before each piece."""
    B, _, c, H, dv = v.shape
    dk = k.shape[-1]
    piece = lambda t, i: t[:, i]  # noqa: E731

    def summary(i):  # [M | S_0] of piece i: from the state [I | 0] with values [0 | v]
        start = jnp.concatenate([jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (B, H, dk, dk)),
                                 jnp.zeros((B, H, dk, dv), jnp.float32)], axis=-1)
        values = jnp.concatenate([jnp.zeros((B, c, H, dk), jnp.float32), piece(v, i).astype(jnp.float32)], axis=-1)
        _, end = kernel(piece(q, i), piece(k, i), values, piece(g, i), piece(beta, i), piece(segment_ids, i),
                        start, segment_before[:, i])
        return end

    summaries = _gathered_by_chunk(jnp.stack([summary(0), summary(1)]), axis, size)  # [2R, B, H, dk, dk + dv]
    incoming = [jnp.zeros((B, H, dk, dv), jnp.float32)]
    for chunk in range(2 * size):  # static: 2R steps of S_in(c + 1) = M_c S_in(c) + S_0(c), the last the final state
        M, S0 = summaries[chunk, ..., :dk], summaries[chunk, ..., dk:]
        incoming.append(M @ incoming[-1] + S0)
    incoming = jnp.stack(incoming)
    outputs = []
    for i, chunk in enumerate(_own_chunks(axis, size)):
        o, _ = kernel(piece(q, i), piece(k, i), piece(v, i), piece(g, i), piece(beta, i), piece(segment_ids, i),
                      incoming[chunk], segment_before[:, i])
        outputs.append(o)
    return jnp.stack(outputs, axis=1), incoming[-1]
