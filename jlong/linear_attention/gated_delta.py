"""The gated delta rule, the recurrence of Gated DeltaNet (Yang, Kautz and
Hatamizadeh, arXiv 2412.06464), as kernels over one device's heads.

Per head, with a state S [dk, dv] that starts at zero (or at a given state):

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T
    o_t = S_t^T q_t

Packed documents: a token whose segment id differs from the token before it
starts from a zero state, so each document runs exactly as if alone.

`chunked` is what the model trains with: the sequence in chunks of
`CHUNK` tokens, each chunk's tokens related to each other by one small
triangular solve (the WY / UT representation of the products of
(I - beta k k^T)), and the state carried from chunk to chunk by a `lax.scan`
with a static trip count. Chunks are grouped in blocks of `CHUNKS_PER_BLOCK`
under a checkpoint, so the backward pass keeps one state per block and
recomputes a block at a time: memory is bounded by a block, not the sequence.
Everything is computed in float32.

`recurrent` is the rule token by token (a `lax.scan` over tokens): the
reference tests compare the chunked form with.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.ops.tiling import varying_like

CHUNK = 128  # tokens related by one triangular solve
CHUNKS_PER_BLOCK = 16  # chunks recomputed together in the backward pass (one saved state per block)


def chunked(q, k, v, g, beta, segment_ids=None, initial_state=None, segment_before=None, *, chunk: int = CHUNK,
            chunks_per_block: int = CHUNKS_PER_BLOCK):
    """o [B, S, H, dv] in v's dtype and the final state [B, H, dk, dv] in float32.

    q, k [B, S, Hk, dk] (Hk dividing H: value head h reads key head h // (H / Hk)),
    v [B, S, H, dv], g (log decay, <= 0) and beta [B, S, H]; `segment_ids`
    [B, S] separate packed documents; `initial_state` [B, H, dk, dv] is the
    state before the first token (zero when None), left by a token of
    segment `segment_before` [B] (unset: the first token's own, so the first
    token continues it; another segment starts afresh)."""
    B, S, H, dv = v.shape
    dk = k.shape[-1]
    if segment_ids is None:
        segment_ids = jnp.zeros((B, S), jnp.int32)
    chunk = min(chunk, 1 << max(S - 1, 1).bit_length())  # a power of two (`unit_lower_inverse`)
    block = chunk * max(1, min(chunks_per_block, -(-S // chunk)))
    padded = -(-S // block) * block
    # Padding at the end neither reads nor changes the state that earlier tokens see (k = beta = 0, g = 0).
    pad = functools.partial(_pad_tokens, extra=padded - S)
    q, k, v, g, beta = map(pad, (q, k, v, g, beta))  # cast to float32 a block at a time
    segment_ids = jnp.pad(segment_ids, [(0, 0), (0, padded - S)], mode="edge")  # padding joins the last document
    # The segment before the first token: the first token's own when it continues `initial_state`.
    first = _segment_before(segment_ids, initial_state, segment_before)
    previous = jnp.concatenate([first, segment_ids[:, :-1]], axis=1)
    state = jnp.zeros((B, H, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    state = varying_like(state, v)  # inside shard_map, the carry varies over the devices as the tokens do

    blocks = padded // block

    def by_block(t):  # [B, S, ...] -> [blocks, B, block, ...] (a reshape alone for one sequence)
        if B == 1:
            return t.reshape(blocks, 1, block, *t.shape[2:])
        return jnp.moveaxis(t.reshape(B, blocks, block, *t.shape[2:]), 1, 0)

    run_block = jax.checkpoint(functools.partial(_block, chunk=chunk), prevent_cse=False)
    state, o = jax.lax.scan(run_block, state, tuple(map(by_block, (q, k, v, g, beta, segment_ids, previous))))
    o = (o if B == 1 else jnp.moveaxis(o, 0, 1)).reshape(B, padded, H, dv)[:, :S]
    return o, state


def _segment_before(segment_ids, initial_state, segment_before):
    """[B, 1]: the segment of the token before the first (-1: none, so no state to continue)."""
    if initial_state is None:
        return jnp.full_like(segment_ids[:, :1], -1)
    return segment_ids[:, :1] if segment_before is None else segment_before[:, None].astype(segment_ids.dtype)


def _pad_tokens(t, *, extra: int):
    if not extra:
        return t
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (t.ndim - 2)
    return jnp.pad(t, widths)


def _block(state, inputs, *, chunk: int):
    """One block of chunks: (state in, (q, k, v, g, beta, segments, previous segments)) -> (state out, o)."""
    q, k, v, g, beta, seg, prev = inputs
    dtype = v.dtype
    q, k, v, g, beta = (t.astype(jnp.float32) for t in (q, k, v, g, beta))
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

    k_beta = k * beta[..., None]
    strictly = ~jnp.eye(chunk, dtype=bool)
    system = jnp.where(strictly, jnp.einsum("...id,...jd->...ij", k_beta, k) * decay, 0.0)
    inverse = unit_lower_inverse(system)  # of I + the strictly lower part
    new_values = inverse @ (v * beta[..., None])  # u: the values the chunk writes, before the state's part
    state_keys = inverse @ (k_beta * (jnp.exp(cum) * reads)[..., None])  # w: how the state's part enters
    intra = jnp.einsum("...id,...jd->...ij", q, k) * decay
    q_read = q * (jnp.exp(cum) * reads)[..., None]
    k_write = k * (jnp.exp(cum[..., -1:] - cum) * writes)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * carries  # [B, H, n]

    def one_chunk(state, xs):
        u, w, a, qr, kw, decay_c = xs
        v_new = u - w @ state
        o = qr @ state + a @ v_new
        state = state * decay_c[..., None, None] + jnp.swapaxes(kw, -1, -2) @ v_new
        return state, o

    along_chunks = [jnp.moveaxis(t, 2, 0) for t in (new_values, state_keys, intra, q_read, k_write)]
    state, o = jax.lax.scan(one_chunk, state, (*along_chunks, jnp.moveaxis(chunk_decay, 2, 0)))
    o = jnp.moveaxis(o, 0, 2)  # [B, H, n, C, dv]
    return state, jnp.moveaxis(o, 1, 3).reshape(B, T, H, dv).astype(dtype)


def unit_lower_inverse(strictly_lower):
    """(I + N)^-1 for strictly lower-triangular N [..., C, C] (C a power of
    two), by doubling the size of the diagonal blocks already inverted: with
    X the inverse of the blocks of size b, the blocks of size 2b are
    [[A, 0], [M, D]]^-1 = [[A^-1, 0], [-D^-1 M A^-1, D^-1]], that is
    X - X (N on the new off-diagonal blocks) X. Two matmuls per doubling
    (log2 C of them), where a triangular solve would be C dependent steps
    (and XLA:CPU's solve can stall multi-device programs)."""
    C = strictly_lower.shape[-1]
    if C & (C - 1):
        raise ValueError(f"chunk size {C} is not a power of two")
    rows = jnp.arange(C)
    inverse = jnp.broadcast_to(jnp.eye(C, dtype=strictly_lower.dtype), strictly_lower.shape)
    size = 1
    while size < C:
        new_blocks = (rows[:, None] // (2 * size) == rows[None, :] // (2 * size)) & \
                     (rows[:, None] // size != rows[None, :] // size)
        inverse = inverse - inverse @ jnp.where(new_blocks, strictly_lower, 0.0) @ inverse
        size *= 2
    return inverse


def recurrent(q, k, v, g, beta, segment_ids=None, initial_state=None, segment_before=None):
    """The rule token by token: the same arguments and results as `chunked`."""
    B, S, H, dv = v.shape
    dk = k.shape[-1]
    group = H // k.shape[2]
    q, k = (jnp.repeat(t.astype(jnp.float32), group, axis=2) for t in (q, k))
    if segment_ids is None:
        segment_ids = jnp.zeros((B, S), jnp.int32)
    first = _segment_before(segment_ids, initial_state, segment_before)
    starts = segment_ids != jnp.concatenate([first, segment_ids[:, :-1]], axis=1)
    state = jnp.zeros((B, H, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    state = varying_like(state, v)

    def step(state, xs):
        q_t, k_t, v_t, g_t, beta_t, start_t = xs
        state = jnp.where(start_t[:, None, None, None], 0.0, state) * jnp.exp(g_t)[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + jnp.einsum("bhk,bhv->bhkv", k_t, (v_t - remembered) * beta_t[..., None])
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    xs = (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), starts)
    state, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 1, 0) for t in xs))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), state


KERNELS = {"chunked": chunked, "recurrent": recurrent}
