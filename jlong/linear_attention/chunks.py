"""What the chunked forms of the gated delta rule share: the inputs padded
to whole chunks with each token's predecessor's segment, and each chunk's
terms (the WY / UT representation of its products of (I - beta k k^T),
attention inside the chunk, the decays), computed for all chunks at once
(float32, or bf16 products with float32 sums: `chunk_terms`), and the
chunks' triangular inverse with its own gradient. The recurrence from chunk
to chunk runs after them (`gated_delta.chunked`, `chunk_recurrence`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jlong.ops.tiling import varying_like

DIAGONAL_BLOCK = 16  # `unit_lower_inverse` inverts diagonal blocks of this size on their own first


def over_blocks(run_block, tokens, segment_ids, initial_state, segment_before, *, block: int):
    """(o [B, S, H, dv] in v's dtype, the final state [B, H, dk, dv] in
    float32) of the rule on `tokens` (q, k, v, g, beta) a block of `block`
    tokens at a time: `run_block(state, (q, k, v, g, beta, segments,
    previous segments))` -> (state, o) on one block, under a checkpoint
    where there are several, so the backward pass keeps one state per block
    and recomputes a block at a time (memory bounded by a block, not the
    sequence)."""
    S = tokens[2].shape[1]
    tokens, segment_ids, previous, state = padded_inputs(tokens, segment_ids, initial_state, segment_before,
                                                         multiple=block)
    B, padded, H, dv = tokens[2].shape
    blocks = padded // block

    def by_block(t):  # [B, S, ...] -> [blocks, B, block, ...] (a reshape alone for one sequence)
        if B == 1:
            return t.reshape(blocks, 1, block, *t.shape[2:])
        return jnp.moveaxis(t.reshape(B, blocks, block, *t.shape[2:]), 1, 0)

    if blocks > 1:
        run_block = jax.checkpoint(run_block, prevent_cse=False)
    state, o = jax.lax.scan(run_block, state, tuple(map(by_block, (*tokens, segment_ids, previous))))
    o = (o if B == 1 else jnp.moveaxis(o, 0, 1)).reshape(B, padded, H, dv)[:, :S]
    return o, state


def padded_inputs(tokens, segment_ids, initial_state, segment_before, *, multiple: int):
    """What the chunked forms start from: the tokens (q, k, v, g, beta)
    padded at the end to a `multiple` of tokens, their segment ids, each
    token's predecessor's segment id ([B, S'] int) and the starting state
    [B, H, dk, dv] in float32 (zeros when `initial_state` is None)."""
    q, k, v, g, beta = tokens
    B, S, H, dv = v.shape
    if segment_ids is None:
        segment_ids = jnp.zeros((B, S), jnp.int32)
    extra = -(-S // multiple) * multiple - S
    # Padding at the end neither reads nor changes the state that earlier tokens see (k = beta = 0, g = 0).
    tokens = tuple(_pad_tokens(t, extra=extra) for t in tokens)
    segment_ids = jnp.pad(segment_ids, [(0, 0), (0, extra)], mode="edge")  # padding joins the last document
    # The segment before the first token: the first token's own when it continues `initial_state`.
    first = segment_before_first(segment_ids, initial_state, segment_before)
    previous = jnp.concatenate([first, segment_ids[:, :-1]], axis=1)
    shape = (B, H, k.shape[-1], dv)
    state = jnp.zeros(shape, jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    # inside shard_map, the state varies over the devices as the tokens do
    return tokens, segment_ids, previous, varying_like(state, v)


def segment_before_first(segment_ids, initial_state, segment_before):
    """[B, 1]: the segment of the token before the first (-1: none, so no state to continue)."""
    if initial_state is None:
        return jnp.full_like(segment_ids[:, :1], -1)
    return segment_ids[:, :1] if segment_before is None else segment_before[:, None].astype(segment_ids.dtype)


def _pad_tokens(t, *, extra: int):
    if not extra:
        return t
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (t.ndim - 2)
    return jnp.pad(t, widths)


class ChunkTerms(NamedTuple):
    """What each chunk of `chunk` tokens contributes, computed for all chunks
    at once ([B, H, n, C, ...]; C = chunk). With S the state entering
    a chunk, the chunk's outputs and the state it leaves are

        v_new = u - w S,   o = qr S + a v_new,   S' = decay S + kw^T v_new

    so only this recurrence runs chunk after chunk."""

    u: jax.Array  # [.., C, dv] the values the chunk writes, before the state's part
    w: jax.Array  # [.., C, dk] how the incoming state enters them
    a: jax.Array  # [.., C, C] attention inside the chunk (causal, within a document, decayed)
    qr: jax.Array  # [.., C, dk] the queries that read the incoming state, decayed
    kw: jax.Array  # [.., C, dk] the keys that write the outgoing state, decayed to the chunk's end
    decay: jax.Array  # [..] the incoming state's decay over the chunk (0 where a document starts inside)


def chunk_terms(q, k, v, g, beta, seg, prev, *, chunk: int, operand=jnp.float32) -> ChunkTerms:
    """`chunk_terms_and_inverse`'s terms."""
    return chunk_terms_and_inverse(q, k, v, g, beta, seg, prev, chunk=chunk, operand=operand)[0]


def chunk_terms_and_inverse(q, k, v, g, beta, seg, prev, *, chunk: int, operand=jnp.float32):
    """The `ChunkTerms` of tokens q, k [B, T, Hk, dk], v [B, T, H, dv], g,
    beta [B, T, H] (T a multiple of `chunk`), segment ids `seg` and each
    token's predecessor's `prev` [B, T].

    The products take their inputs in `operand`: float32 (at the precision
    in force), or bf16 with float32 accumulation (as FLA's kernels, at half
    the memory traffic). The decays and the triangular inverse are computed
    in float32 (the inverse enters u's and w's products in `operand`); the
    terms are rounded to `operand`, the decays float32. The inverses
    (I + N)^-1 are returned beside the terms [B, H, n, C, C] float32, as a
    backend's kernel for the terms returns them for its gradient's
    (`chunk_terms_triton`, whose tests compare with these)."""
    q, k, v = (t.astype(operand) for t in (q, k, v))
    g, beta = (t.astype(jnp.float32) for t in (g, beta))
    B, T, H, dv = v.shape
    group = H // k.shape[2]
    q, k = (jnp.repeat(t, group, axis=2) for t in (q, k))
    n = T // chunk

    def chunks(t):  # [B, T, H, ...] -> [B, H, n, chunk, ...]
        t = t.reshape(B, n, chunk, *t.shape[2:])
        return jnp.moveaxis(t, 3, 1)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    seg = seg.reshape(B, 1, n, chunk)
    before = prev.reshape(B, 1, n, chunk)[..., :1]  # the segment of the token before each chunk
    last = seg[..., -1:]

    cum = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk's start through each token
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    same = causal & (seg[..., :, None] == seg[..., None, :])  # [B, 1, n, C, C]: j <= i in one document
    decay = jnp.where(same, jnp.exp(jnp.where(same, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    reads = seg == before  # tokens of the document that runs into the chunk read the incoming state
    writes = seg == last  # tokens of the document that runs out of the chunk write the outgoing state
    carries = (last == before)[..., 0]  # [B, 1, n]: no document starts inside the chunk

    def scaled(t, by):  # t x by per token, in `operand`
        return (t * by[..., None]).astype(operand)

    def product(spec, x, y):
        return jnp.einsum(spec, x.astype(operand), y.astype(operand), preferred_element_type=jnp.float32)

    k_beta = scaled(k, beta)
    strictly = ~jnp.eye(chunk, dtype=bool)
    system = jnp.where(strictly, product("...id,...jd->...ij", k_beta, k) * decay, 0.0)
    inverse = unit_lower_inverse(system)  # of I + the strictly lower part
    terms = ChunkTerms(
        u=product("...ij,...jv->...iv", inverse, scaled(v, beta)).astype(operand),
        w=product("...ij,...jd->...id", inverse, scaled(k_beta, jnp.exp(cum) * reads)).astype(operand),
        a=(product("...id,...jd->...ij", q, k) * decay).astype(operand),
        qr=scaled(q, jnp.exp(cum) * reads),
        kw=scaled(k, jnp.exp(cum[..., -1:] - cum) * writes),
        decay=jnp.exp(cum[..., -1]) * carries,
    )
    return terms, inverse


@jax.custom_vjp
def unit_lower_inverse(strictly_lower):
    """(I + N)^-1 for strictly lower-triangular N [..., C, C] in XLA, on any
    backend (`_doubling_inverse`), differentiable: its gradient is the
    inverse's own, -X^T dX X^T on the strictly lower part, two matmuls, where
    autodiff through the doublings would keep and revisit every step's
    [..., C, C] products (most of the rule's memory traffic on a GPU)."""
    return _doubling_inverse(strictly_lower)


def _inverse_forward(strictly_lower):
    X = _doubling_inverse(strictly_lower)
    return X, X


def _doubling_inverse(strictly_lower):
    """(I + N)^-1 (C a power of two) by doubling the size of the diagonal
    blocks already inverted: with X the inverse of the blocks of size b, the
    blocks of size 2b are [[A, 0], [M, D]]^-1 = [[A^-1, 0], [-D^-1 M A^-1,
    D^-1]], that is X - X (N on the new off-diagonal blocks) X. Two matmuls
    per doubling (log2 C of them), where a triangular solve would be C
    dependent steps (and XLA:CPU's solve can stall multi-device programs)."""
    C = strictly_lower.shape[-1]
    if C & (C - 1):
        raise ValueError(f"chunk size {C} is not a power of two")
    # The first doublings only fill diagonal blocks of up to DIAGONAL_BLOCK: run them on those blocks
    # alone ([..., C / b, b, b], a fraction b / C of the full products' work and memory traffic).
    b = min(C, DIAGONAL_BLOCK)
    blocks = C // b
    tiled = strictly_lower.reshape(*strictly_lower.shape[:-2], blocks, b, blocks, b)
    diagonal = jnp.diagonal(tiled, axis1=-4, axis2=-2)  # [..., b, b, blocks]
    inverse = _doublings(jnp.moveaxis(diagonal, -1, -3), 1, b)  # [..., blocks, b, b]
    eye = jnp.eye(blocks, dtype=bool)[:, None, :, None]
    inverse = jnp.where(eye, jnp.expand_dims(inverse, -2), 0.0)  # [..., blocks, b, blocks, b]
    inverse = inverse.reshape(strictly_lower.shape)  # block diagonal
    return _doublings(strictly_lower, b, C, inverse)


def _doublings(strictly_lower, size: int, until: int, inverse=None):
    """The inverse of (I + N) on diagonal blocks of `until`, from its inverse on blocks of `size`
    (the identity when `inverse` is None and `size` is 1)."""
    C = strictly_lower.shape[-1]
    rows = jnp.arange(C)
    if inverse is None:
        inverse = jnp.broadcast_to(jnp.eye(C, dtype=strictly_lower.dtype), strictly_lower.shape)
    while size < until:
        new = new_blocks(rows[:, None], rows[None, :], size)
        inverse = inverse - inverse @ jnp.where(new, strictly_lower, 0.0) @ inverse
        size *= 2
    return inverse


def new_blocks(rows, columns, size: int):
    """Where a doubling from diagonal blocks of `size` to blocks of 2 `size` fills in: the entries (rows,
    columns broadcast against each other) in one new block but not in one old block."""
    return (rows // (2 * size) == columns // (2 * size)) & (rows // size != columns // size)


def _inverse_backward(inverse, d_inverse):
    transposed = jnp.swapaxes(inverse, -1, -2)
    C = inverse.shape[-1]
    return (jnp.where(jnp.tri(C, k=-1, dtype=bool), -(transposed @ d_inverse @ transposed), 0.0),)


unit_lower_inverse.defvjp(_inverse_forward, _inverse_backward)
