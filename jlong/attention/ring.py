"""Ring attention over a mesh axis, for the per-device code of `shard_map`.

Each of the R devices of the ring holds one chunk of the sequence: its
queries, keys and values [B, s, heads, d], with each token's index in the
whole sequence (`token_index`, [s]) and, for packed documents, its segment
id. The keys and values travel around the ring with `ppermute`; each device
attends its queries to the chunk it holds at each of the R steps and merges
the partial results by their log-sum-exp. Masks come from the token indices,
so any order of the chunks works: jlong lays the sequence out zigzag
(`jlong.parallel.zigzag`), which gives every device the same causal work.

The custom VJP saves only the device's own chunk (q, k, v, output and
log-sum-exp): the backward pass sends the keys and values around the ring
again, with their gradients travelling along and arriving home after R
steps. The travelling gradients are in the keys' dtype, as every activation
gradient between layers is (bf16 at scale: half the bytes held and sent);
each device adds its part to them in float32, block by block, and rounds
once per hop. The queries' gradient stays home and sums in float32.
Within a step the work goes block by block (flash-style, blocks of T
tokens), skipping blocks that causality hides entirely.

Shape letters: s = tokens of the chunk, n blocks of T tokens (s = n*T), K kv
heads with G query heads each.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name

from jlong.attention.kernels import ATTENTION_LSE, ATTENTION_OUT, MASKED, blocks, group_queries


def ring_attention(q_BsHd, k_BsKd, v_BsKd, token_index_s, segment_ids_Bs, *, axis: str, size: int, block_size: int):
    """Causal attention of this device's queries over the whole ring's keys and values."""
    block = min(block_size, q_BsHd.shape[1])
    if q_BsHd.shape[1] % block:
        raise ValueError(f"a ring chunk of {q_BsHd.shape[1]} tokens does not split into blocks of {block}")
    return _ring(q_BsHd, k_BsKd, v_BsKd, token_index_s, segment_ids_Bs, axis, size, block)


def _while_range(lower: int, upper: int, body, carry):
    """`fori_loop` as a while loop, always. A loop with static bounds becomes a
    scan, and a scan inside the attention stages' checkpointed scan lets
    autodiff stack its per-iteration values (every block's scores, ring step
    by ring step) as residuals; a while loop has none to stack."""

    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    start = jnp.asarray(lower, jnp.int32)
    return jax.lax.while_loop(lambda state: state[0] < upper, step, (start, carry))[1]


def _next_on_ring(x, axis, size):
    return jax.lax.ppermute(x, axis, [(i, (i + 1) % size) for i in range(size)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, index, segments, axis, size, block):
    return _ring_forward(q, k, v, index, segments, axis, size, block)[0]


def _ring_forward(q, k, v, index, segments, axis, size, block):
    chunk = _Chunk(q, index, segments, block)
    o_BsHd, lse_BKGs = chunk.attend_to(k, v, index, segments)

    def step(_, carry):
        o_BsHd, lse_BKGs, kv = carry
        kv = _next_on_ring(kv, axis, size)
        o_t, lse_t = chunk.attend_to(*kv)
        # Merge two partial softmaxes by their log-sum-exp, in float32.
        lse_new = jnp.logaddexp(lse_BKGs, lse_t)
        scale_old, scale_t = (_per_query(jnp.exp(x - lse_new)) for x in (lse_BKGs, lse_t))
        return o_BsHd * scale_old + o_t * scale_t, lse_new, kv

    o_BsHd = o_BsHd.astype(jnp.float32)
    o_BsHd, lse_BKGs, _ = _while_range(1, size, step, (o_BsHd, lse_BKGs, (k, v, index, segments)))
    # Named like the blockwise kernel's, so the stage policy keeps them.
    o_BsHd = checkpoint_name(o_BsHd.astype(q.dtype), ATTENTION_OUT)
    lse_BKGs = checkpoint_name(lse_BKGs, ATTENTION_LSE)
    return o_BsHd, (q, k, v, index, segments, o_BsHd, lse_BKGs)


def _ring_backward(axis, size, block, residuals, do_BsHd):
    q, k, v, index, segments, o_BsHd, lse_BKGs = residuals
    chunk = _Chunk(q, index, segments, block, do=do_BsHd, o=o_BsHd, lse=lse_BKGs)

    def step(_, carry):
        dq, travelling = carry
        k, v, k_index, k_segments, dk, dv = travelling
        dq, dk, dv = chunk.add_gradients(k, v, k_index, k_segments, dq, dk, dv)
        # After `size` steps every chunk's keys, values and summed gradients are home.
        return dq, _next_on_ring((k, v, k_index, k_segments, dk, dv), axis, size)

    # Sums in blocks: dq [B, n, T, K, G, d] in float32, the travelling dk and dv [B, n, T, K, d] in k's dtype.
    K = k.shape[2]
    zeros_k = jnp.zeros_like(blocks(k, block))
    start = (jnp.zeros_like(chunk.grouped_blocks(q, K), jnp.float32), (k, v, index, segments, zeros_k, zeros_k))
    dq, (_, _, _, _, dk, dv) = _while_range(0, size, step, start)
    dq, dk = dq * chunk.scale, dk.astype(jnp.float32) * chunk.scale
    return dq.reshape(q.shape).astype(q.dtype), dk.reshape(k.shape).astype(k.dtype), dv.reshape(v.shape), None, None


_ring.defvjp(_ring_forward, _ring_backward)


def _per_query(x_BKGs):
    """[B, K, G, s] -> [B, s, K*G, 1], to scale outputs [B, s, H, d]."""
    return rearrange(x_BKGs, "b k g s -> b s (k g)")[..., None]


class _Chunk:
    """This device's queries, cut into blocks, against any chunk of keys."""

    def __init__(self, q_BsHd, index_s, segments_Bs, block, *, do=None, o=None, lse=None):
        self.block = block
        self.scale = q_BsHd.shape[-1] ** -0.5
        self.q = q_BsHd
        self.index_nT = index_s.reshape(-1, block)
        self.segments_BnT = None if segments_Bs is None else blocks(segments_Bs, block)
        self.do, self.o, self.lse = do, o, lse

    def grouped_blocks(self, x_BsHd, K):
        """[B, s, H, d] -> [B, n, T, K, G, d] (a reshape)."""
        return blocks(group_queries(x_BsHd, K), self.block)

    def attend_to(self, k_BsKd, v_BsKd, k_index_s, k_segments_Bs):
        """(output [B, s, H, d] float32, log-sum-exp [B, K, G, s]) of these queries over this key chunk alone;
        queries that see none of it get output 0 and log-sum-exp -1e30."""
        K = k_BsKd.shape[2]
        q_BnTKGd = self.grouped_blocks(self.q, K)
        keys = _KeyBlocks(k_BsKd, v_BsKd, k_index_s, k_segments_Bs, self.block)
        B, _, _, G, d = q_BnTKGd.shape[:1] + q_BnTKGd.shape[2:]
        T = self.block

        def query_block(i):
            q_BTKGd = q_BnTKGd[:, i]
            stats_BKGT = jnp.zeros_like(q_BTKGd, jnp.float32, (B, K, G, T))
            acc_BKGTd = jnp.zeros_like(q_BTKGd, jnp.float32, (B, K, G, T, d))

            def key_block(j, carry):
                def visit(carry):
                    m_BKGT, l_BKGT, acc_BKGTd = carry
                    s_BKGTT, mask = self._scores(q_BTKGd, i, keys, j)
                    m_new = jnp.maximum(m_BKGT, s_BKGTT.max(-1))
                    p_BKGTT = jnp.where(mask, jnp.exp(s_BKGTT - m_new[..., None]), 0.0)
                    correction = jnp.exp(m_BKGT - m_new)
                    pv_BKGTd = jnp.einsum("bkgqs,bskd->bkgqd", p_BKGTT.astype(keys.v.dtype), keys.v[:, j],
                                          preferred_element_type=jnp.float32)
                    return m_new, l_BKGT * correction + p_BKGTT.sum(-1), acc_BKGTd * correction[..., None] + pv_BKGTd

                return jax.lax.cond(self._any_visible(i, keys, j), visit, lambda c: c, carry)

            m_BKGT, l_BKGT, acc_BKGTd = _while_range(
                0, keys.count, key_block, (stats_BKGT + MASKED, stats_BKGT, acc_BKGTd))
            seen = l_BKGT > 0
            o_BKGTd = jnp.where(seen[..., None], acc_BKGTd / jnp.where(seen, l_BKGT, 1.0)[..., None], 0.0)
            lse_BKGT = jnp.where(seen, m_BKGT + jnp.log(jnp.where(seen, l_BKGT, 1.0)), MASKED)
            return rearrange(o_BKGTd, "b k g q d -> b q (k g) d"), lse_BKGT

        o_nBTHd, lse_nBKGT = jax.lax.map(query_block, jnp.arange(self.index_nT.shape[0]))
        return rearrange(o_nBTHd, "n b q h d -> b (n q) h d"), rearrange(lse_nBKGT, "n b k g q -> b k g (n q)")

    def add_gradients(self, k_BsKd, v_BsKd, k_index_s, k_segments_Bs, dq_BnTKGd, dk_BnTKd, dv_BnTKd):
        """Adds these queries' part of the gradients through this key chunk into
        the sums dq, dk and dv (dq and dk without the 1/sqrt(d) factor), block
        by block in place and in float32 (dk and dv are kept in their own
        dtype between blocks), given the merged output and log-sum-exp over
        the whole ring (the softmax is the ring's, not the chunk's)."""
        K = k_BsKd.shape[2]
        T = self.block
        q_BnTKGd = self.grouped_blocks(self.q, K)
        do_BnTKGd = self.grouped_blocks(self.do, K)
        keys = _KeyBlocks(k_BsKd, v_BsKd, k_index_s, k_segments_Bs, T)
        n = self.index_nT.shape[0]
        lse_nBKGT = rearrange(self.lse, "b k g (n q) -> n b k g q", q=T)
        # delta = rowsum(dO * O): the softmax Jacobian's correction term.
        delta_BsH = jnp.sum(self.do.astype(jnp.float32) * self.o.astype(jnp.float32), axis=-1)
        delta_nBKGT = rearrange(delta_BsH, "b (n q) (k g) -> n b k g q", q=T, k=K)

        def probs_and_dscores(i, j):
            s_BKGTT, mask = self._scores(q_BnTKGd[:, i], i, keys, j)
            p_BKGTT = jnp.where(mask, jnp.exp(s_BKGTT - lse_nBKGT[i][..., None]), 0.0)
            dp_BKGTT = jnp.einsum("bqkgd,bskd->bkgqs", do_BnTKGd[:, i], keys.v[:, j],
                                  preferred_element_type=jnp.float32)
            return p_BKGTT, p_BKGTT * (dp_BKGTT - delta_nBKGT[i][..., None])

        def dq_block(i, dq_BnTKGd):
            def step(j, dq_BTKGd):
                def visit(dq_BTKGd):
                    _, ds_BKGTT = probs_and_dscores(i, j)
                    return dq_BTKGd + jnp.einsum("bkgqs,bskd->bqkgd", ds_BKGTT, keys.k[:, j].astype(jnp.float32))

                return jax.lax.cond(self._any_visible(i, keys, j), visit, lambda x: x, dq_BTKGd)

            return dq_BnTKGd.at[:, i].set(_while_range(0, keys.count, step, dq_BnTKGd[:, i]))

        def dkv_block(j, sums):
            def step(i, carry):
                def visit(carry):
                    dk_BTKd, dv_BTKd = carry
                    p_BKGTT, ds_BKGTT = probs_and_dscores(i, j)
                    dv_BTKd = dv_BTKd + jnp.einsum("bkgqs,bqkgd->bskd", p_BKGTT, do_BnTKGd[:, i].astype(jnp.float32))
                    dk_BTKd = dk_BTKd + jnp.einsum("bkgqs,bqkgd->bskd", ds_BKGTT, q_BnTKGd[:, i].astype(jnp.float32))
                    return dk_BTKd, dv_BTKd

                return jax.lax.cond(self._any_visible(i, keys, j), visit, lambda c: c, carry)

            dk_BnTKd, dv_BnTKd = sums
            sums_BTKd = tuple(x[:, j].astype(jnp.float32) for x in (dk_BnTKd, dv_BnTKd))
            dk_BTKd, dv_BTKd = (x.astype(dk_BnTKd.dtype) for x in _while_range(0, n, step, sums_BTKd))
            return dk_BnTKd.at[:, j].set(dk_BTKd), dv_BnTKd.at[:, j].set(dv_BTKd)

        dq_BnTKGd = _while_range(0, n, dq_block, dq_BnTKGd)
        dk_BnTKd, dv_BnTKd = _while_range(0, keys.count, dkv_block, (dk_BnTKd, dv_BnTKd))
        return dq_BnTKGd, dk_BnTKd, dv_BnTKd

    def _scores(self, q_BTKGd, i, keys, j):
        """Masked scores [B, K, G, T, T] of query block i against key block j, and the mask."""
        s_BKGTT = jnp.einsum("bqkgd,bskd->bkgqs", q_BTKGd, keys.k[:, j], preferred_element_type=jnp.float32)
        mask = (keys.index_nT[j][None, :] <= self.index_nT[i][:, None])[None]
        if self.segments_BnT is not None:
            mask = mask & (self.segments_BnT[:, i][:, :, None] == keys.segments_BnT[:, j][:, None, :])
        mask = mask[:, None, None]
        return jnp.where(mask, s_BKGTT * self.scale, MASKED), mask

    def _any_visible(self, i, keys, j):
        """Whether causality leaves any pair of query block i and key block j visible."""
        return keys.index_nT[j].min() <= self.index_nT[i].max()


class _KeyBlocks:
    def __init__(self, k_BsKd, v_BsKd, index_s, segments_Bs, block):
        self.k, self.v = blocks(k_BsKd, block), blocks(v_BsKd, block)
        self.index_nT = index_s.reshape(-1, block)
        self.segments_BnT = None if segments_Bs is None else blocks(segments_Bs, block)
        self.count = self.index_nT.shape[0]

