"""The flash step in plain XLA: online softmax over blocks of T tokens.

Runs on any backend (the CPU tests' kernel, and the GPU's where cuDNN does
not apply). Memory is O(window x T): no [Tq, Tk] score matrix exists, only
one [T, T] block at a time. A causal step visits only the blocks on and
below the diagonal, and a sliding window (`Band`) only the blocks within it.

Shape letters: n blocks of T tokens, K kv heads with G query heads each.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange

from jlong.attention.step import MASKED, Band, Documents
from jlong.options import DEFAULT_BLOCK_SIZE


def group_queries(x_BSHd, num_kv_heads: int):
    """[B, S, H, d] -> [B, S, K, G, d]: query heads grouped by their kv head."""
    return rearrange(x_BSHd, "b s (k g) d -> b s k g d", k=num_kv_heads)


def while_range(lower, upper, body, carry):
    """`fori_loop` as a while loop, always. A loop with static bounds becomes a
    scan, and a scan inside the attention stages' checkpointed scan lets
    autodiff stack its per-iteration values (every block's scores) as
    residuals; a while loop has none to stack."""

    def step(state):
        i, carry = state
        return i + 1, body(i, carry)

    start = jnp.asarray(lower, jnp.int32)
    return jax.lax.while_loop(lambda state: state[0] < upper, step, (start, carry))[1]


@dataclasses.dataclass(frozen=True)
class BlockwiseStep:
    """The step kernel of `jlong.attention.step`, block by block."""

    block_size: int = DEFAULT_BLOCK_SIZE

    def forward(self, q_BqHd, k_BkKd, v_BkKd, docs: Documents | None, causal: bool, band: Band | None = None):
        w = _Window(q_BqHd, k_BkKd, v_BkKd, docs, causal, band, self.block_size)
        B, _, K, G, _ = w.q_BnTKGd.shape[:1] + w.q_BnTKGd.shape[2:]
        T, dv = w.block, v_BkKd.shape[-1]  # values may be of a head size of their own (latent attention)

        def query_block(i):
            q_BTKGd = w.q_BnTKGd[:, i]
            stats_BKGT = jnp.zeros_like(q_BTKGd, jnp.float32, (B, K, G, T))  # running max, sum
            acc_BKGTd = jnp.zeros_like(q_BTKGd, jnp.float32, (B, K, G, T, dv))

            def key_block(j, carry):
                m_BKGT, l_BKGT, acc_BKGTd = carry
                s_BKGTT, mask = w.scores(q_BTKGd, i, j)
                m_new = jnp.maximum(m_BKGT, s_BKGTT.max(-1))
                p_BKGTT = jnp.where(mask, jnp.exp(s_BKGTT - m_new[..., None]), 0.0)
                correction = jnp.exp(m_BKGT - m_new)
                pv_BKGTd = jnp.einsum("bkgqs,bskd->bkgqd", p_BKGTT.astype(w.v_BnTKd.dtype), w.v_BnTKd[:, j],
                                      preferred_element_type=jnp.float32)
                return m_new, l_BKGT * correction + p_BKGTT.sum(-1), acc_BKGTd * correction[..., None] + pv_BKGTd

            m_BKGT, l_BKGT, acc_BKGTd = while_range(*w.keys_seen_by(i), key_block,
                                                    (stats_BKGT + MASKED, stats_BKGT, acc_BKGTd))
            seen = l_BKGT > 0
            safe_l = jnp.where(seen, l_BKGT, 1.0)
            o_BKGTd = jnp.where(seen[..., None], acc_BKGTd / safe_l[..., None], 0.0)
            return o_BKGTd, jnp.where(seen, m_BKGT + jnp.log(safe_l), MASKED)

        o_nBKGTd, lse_nBKGT = jax.lax.map(query_block, jnp.arange(w.query_blocks))
        o_BqHd = rearrange(o_nBKGTd, "n b k g q d -> b (n q) (k g) d")[:, :w.q_len]
        return o_BqHd, rearrange(lse_nBKGT, "n b k g q -> b (k g) (n q)")[:, :, :w.q_len]

    def backward(self, q_BqHd, k_BkKd, v_BkKd, docs: Documents | None, causal: bool, o_BqHd, lse_BHq, do_BqHd,
                 band: Band | None = None):
        w = _Window(q_BqHd, k_BkKd, v_BkKd, docs, causal, band, self.block_size)
        K = k_BkKd.shape[2]
        do_BnTKGd = w.blocks(group_queries(do_BqHd, K))
        # delta = rowsum(dO * O): the softmax Jacobian's correction term.
        delta_BqH = jnp.sum(do_BqHd.astype(jnp.float32) * o_BqHd.astype(jnp.float32), axis=-1)
        delta_nBKGT = _query_blocks(rearrange(delta_BqH, "b q h -> b h q"), w, K)
        lse_nBKGT = _query_blocks(lse_BHq, w, K)

        def probs_and_dscores(i, j):
            s_BKGTT, mask = w.scores(w.q_BnTKGd[:, i], i, j)
            p_BKGTT = jnp.where(mask, jnp.exp(s_BKGTT - lse_nBKGT[i][..., None]), 0.0)
            dp_BKGTT = jnp.einsum("bqkgd,bskd->bkgqs", do_BnTKGd[:, i], w.v_BnTKd[:, j],
                                  preferred_element_type=jnp.float32)
            return p_BKGTT, p_BKGTT * (dp_BKGTT - delta_nBKGT[i][..., None])

        def dq_block(i):
            def step(j, dq_BTKGd):
                _, ds_BKGTT = probs_and_dscores(i, j)
                return dq_BTKGd + jnp.einsum("bkgqs,bskd->bqkgd", ds_BKGTT, w.k_BnTKd[:, j].astype(jnp.float32))

            return while_range(*w.keys_seen_by(i), step, jnp.zeros_like(w.q_BnTKGd[:, 0], jnp.float32))

        def dkv_block(j):
            def step(i, carry):
                dk_BTKd, dv_BTKd = carry
                p_BKGTT, ds_BKGTT = probs_and_dscores(i, j)
                dv_BTKd = dv_BTKd + jnp.einsum("bkgqs,bqkgd->bskd", p_BKGTT, do_BnTKGd[:, i].astype(jnp.float32))
                dk_BTKd = dk_BTKd + jnp.einsum("bkgqs,bqkgd->bskd", ds_BKGTT, w.q_BnTKGd[:, i].astype(jnp.float32))
                return dk_BTKd, dv_BTKd

            zeros = (jnp.zeros_like(w.k_BnTKd[:, 0], jnp.float32), jnp.zeros_like(w.v_BnTKd[:, 0], jnp.float32))
            return while_range(*w.queries_seeing(j), step, zeros)

        dq_nBTKGd = jax.lax.map(dq_block, jnp.arange(w.query_blocks))
        dk_nBTKd, dv_nBTKd = jax.lax.map(dkv_block, jnp.arange(w.key_blocks))
        dq_BqHd = rearrange(dq_nBTKGd, "n b q k g d -> b (n q) (k g) d")[:, :w.q_len] * w.scale
        dk_BkKd = rearrange(dk_nBTKd, "n b s k d -> b (n s) k d")[:, :w.k_len] * w.scale
        return dq_BqHd, dk_BkKd, rearrange(dv_nBTKd, "n b s k d -> b (n s) k d")[:, :w.k_len]


def _query_blocks(x_BHq, w: _Window, K):
    """Per-query values [B, H, Tq] -> [n, B, K, G, T], padded like the queries."""
    x_BHq = jnp.pad(x_BHq, [(0, 0), (0, 0), (0, w.query_blocks * w.block - w.q_len)])
    return rearrange(x_BHq, "b (k g) (n q) -> n b k g q", k=K, q=w.block)


class _Window:
    """A step's queries, keys and values cut into blocks of T tokens (each
    side padded at its end to whole blocks; padded keys are masked)."""

    def __init__(self, q_BqHd, k_BkKd, v_BkKd, docs: Documents | None, causal: bool, band: Band | None,
                 block_size: int):
        self.q_len, self.k_len = q_BqHd.shape[1], k_BkKd.shape[1]
        self.block = min(block_size, self.q_len, self.k_len)
        self.causal, self.band = causal, band
        self.scale = q_BqHd.shape[-1] ** -0.5
        self.q_BnTKGd = self.blocks(group_queries(q_BqHd, k_BkKd.shape[2]))
        self.k_BnTKd, self.v_BnTKd = self.blocks(k_BkKd), self.blocks(v_BkKd)
        self.query_blocks, self.key_blocks = self.q_BnTKGd.shape[1], self.k_BnTKd.shape[1]
        self.docs = None if docs is None else Documents(self.blocks(docs.q), self.blocks(docs.k))

    def blocks(self, x_BS):
        """[B, S, ...] -> [B, n, T, ...], padded at the end to whole blocks."""
        padded = -(-x_BS.shape[1] // self.block) * self.block
        x_BS = jnp.pad(x_BS, [(0, 0), (0, padded - x_BS.shape[1])] + [(0, 0)] * (x_BS.ndim - 2))
        return x_BS.reshape(x_BS.shape[0], padded // self.block, self.block, *x_BS.shape[2:])

    def keys_seen_by(self, i):
        """Key blocks [first, last) that query block i can see: on and below
        the diagonal if causal, and within the band's reach."""
        last = i + 1 if self.causal else self.key_blocks
        if self.band is None:
            return 0, last
        T, (w, D) = self.block, self.band
        # Key block j is within reach while D + i*T - (j*T + T - 1) < w.
        return jnp.maximum((D + (i - 1) * T + 1 - w) // T + 1, 0), last

    def queries_seeing(self, j):
        """Query blocks [first, last) that can see key block j."""
        first = j if self.causal else 0
        if self.band is None:
            return first, self.query_blocks
        T, (w, D) = self.block, self.band
        # Query block i reaches key block j while i*T < w - D + (j + 1)*T - 1.
        return first, jnp.clip((w - D + (j + 1) * T - 1 + T - 1) // T, 0, self.query_blocks)

    def scores(self, q_BTKGd, i, j):
        """Masked scores [B, K, G, T, T] of query block i against key block j, and the mask."""
        s_BKGTT = jnp.einsum("bqkgd,bskd->bkgqs", q_BTKGd, self.k_BnTKd[:, j], preferred_element_type=jnp.float32)
        k_index = j * self.block + jnp.arange(self.block)
        mask_TT = jnp.broadcast_to(k_index < self.k_len, (self.block, self.block))
        q_index = i * self.block + jnp.arange(self.block)
        if self.causal:
            mask_TT &= k_index[None, :] <= q_index[:, None]
        if self.band is not None:
            mask_TT &= self.band.distance + q_index[:, None] - k_index[None, :] < self.band.length
        mask = mask_TT[None]
        if self.docs is not None:
            mask = mask & (self.docs.q[:, i][:, :, None] == self.docs.k[:, j][:, None, :])
        mask = mask[:, None, None]
        return jnp.where(mask, s_BKGTT * self.scale, MASKED), mask
