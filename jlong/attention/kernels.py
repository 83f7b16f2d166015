"""Causal self-attention kernels behind one interface, `attend`.

All kernels take q [B, S, H, d] and k, v [B, S, K, d] (H a multiple of K:
grouped-query attention without repeating k and v), optional segment ids
[B, S] (tokens attend only within their own segment, so packed documents
never see each other), and return o [B, S, H, d] in q's dtype.

- `reference`: plain XLA with the S x S score matrix; for tests.
- `blockwise`: flash-style online softmax over query and key blocks with a
  custom VJP that saves only the output and the log-sum-exp, so memory is
  O(S x block) in the forward and the backward pass. Runs anywhere.
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`; GPU only,
  16-bit inputs, no segment ids.
- `auto`: cuDNN where it applies, blockwise otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from einops import rearrange
from jax.ad_checkpoint import checkpoint_name

from jlong.errors import JlongError
from jlong.options import ATTENTION_IMPLS, AttentionImpl

# Names of the blockwise kernel's saved output and log-sum-exp, for remat
# policies that keep them (and so skip re-running the attention forward).
ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"

# Finite stand-in for -inf, so fully masked blocks give exp(..) = 0, not NaN
# (also the ring kernel's).
MASKED = -1e30


def attend(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None, *, impl: AttentionImpl = "auto", block_size: int = 512):
    """Causal attention of q [B,S,H,d] over k, v [B,S,K,d]; see the module doc."""
    if impl == "auto":
        impl = "cudnn" if cudnn_applies(q_BSHd, segment_ids_BS) else "blockwise"
    if impl == "reference":
        return reference_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS)
    if impl == "blockwise":
        return blockwise_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, block_size=block_size)
    if impl == "cudnn":
        if segment_ids_BS is not None:
            raise JlongError(
                "attention.impl=cudnn cannot mask packed documents (segment ids); "
                "use attention.impl=auto or blockwise"
            )
        return jax.nn.dot_product_attention(q_BSHd, k_BSKd, v_BSKd, is_causal=True, implementation="cudnn")
    raise JlongError(f"attention.impl must be one of {', '.join(ATTENTION_IMPLS)}, got {impl!r}")


def cudnn_applies(q_BSHd, segment_ids_BS) -> bool:
    """Whether the cuDNN fused kernel can run these inputs on this backend."""
    kernel = choose_kernel("auto", platform=jax.default_backend(), dtype=q_BSHd.dtype, seq_len=q_BSHd.shape[1],
                           head_dim=q_BSHd.shape[-1], packed=segment_ids_BS is not None)
    return kernel == "cudnn"


def choose_kernel(impl: AttentionImpl, *, platform: str, dtype, seq_len: int, head_dim: int, packed: bool) -> str:
    """The kernel `impl` stands for on `platform` ("gpu" or "cpu"): `auto` is
    cuDNN where it applies (16-bit inputs, an even sequence length, head_dim
    <= 256 and a multiple of 8, no packed documents), blockwise elsewhere."""
    if impl != "auto":
        return impl
    cudnn = (
        platform == "gpu"
        and not packed
        and seq_len % 2 == 0  # cuDNN's training kernels refuse odd lengths
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and head_dim <= 256
        and head_dim % 8 == 0
    )
    return "cudnn" if cudnn else "blockwise"


def group_queries(q_BSHd, num_kv_heads: int):
    """[B, S, H, d] -> [B, S, K, G, d]: query heads grouped by their kv head."""
    return rearrange(q_BSHd, "b s (k g) d -> b s k g d", k=num_kv_heads)


def _visible(q_index, k_index, q_segments, k_segments):
    """Causal and same-segment mask, broadcast to [B, 1, 1, Tq, Tk]."""
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None, None]


def reference_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None):
    """Materialises the full score matrix; the ground truth for tests."""
    S, d = q_BSHd.shape[1], q_BSHd.shape[3]
    q_BSKGd = group_queries(q_BSHd, k_BSKd.shape[2])
    scores_BKGSS = jnp.einsum("bqkgd,bskd->bkgqs", q_BSKGd, k_BSKd, preferred_element_type=jnp.float32) * (d**-0.5)
    index = jnp.arange(S)
    scores_BKGSS = jnp.where(_visible(index, index, segment_ids_BS, segment_ids_BS), scores_BKGSS, MASKED)
    probs_BKGSS = jax.nn.softmax(scores_BKGSS, axis=-1)
    o_BSKGd = jnp.einsum("bkgqs,bskd->bqkgd", probs_BKGSS.astype(v_BSKd.dtype), v_BSKd,
                         preferred_element_type=jnp.float32)
    return rearrange(o_BSKGd, "b q k g d -> b q (k g) d").astype(q_BSHd.dtype)


# --------------------------------------------------------------------------
# Blockwise (flash-style) attention
#
# Shape letters: n blocks of T tokens (S = n*T), G query heads per kv head.


def blockwise_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None, *, block_size: int = 512):
    """Flash-style attention; S need not be a multiple of the block size."""
    S = q_BSHd.shape[1]
    block = min(block_size, S)
    padded = -(-S // block) * block
    if padded != S:
        # Padding goes at the end, so causality hides it from every real query;
        # the padded queries' outputs are dropped below.
        pad = [(0, 0), (0, padded - S)]
        q_BSHd, k_BSKd, v_BSKd = (jnp.pad(x, pad + [(0, 0), (0, 0)]) for x in (q_BSHd, k_BSKd, v_BSKd))
        if segment_ids_BS is not None:
            segment_ids_BS = jnp.pad(segment_ids_BS, pad, constant_values=-1)
    o_BSHd = _flash(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, block)
    return o_BSHd[:, :S]


def blocks(x, block):
    """[B, S, ...] -> [B, n, T, ...]."""
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def _block_scores(q_BTKGd, k_BTKd, i, j, seg_BnT, block, scale):
    """Masked scores [B, K, G, T, T] of query block i against key block j, and the mask."""
    s_BKGTT = jnp.einsum("bqkgd,bskd->bkgqs", q_BTKGd, k_BTKd, preferred_element_type=jnp.float32) * scale
    q_index = i * block + jnp.arange(block)
    k_index = j * block + jnp.arange(block)
    q_seg = k_seg = None
    if seg_BnT is not None:
        q_seg, k_seg = seg_BnT[:, i], seg_BnT[:, j]
    mask = _visible(q_index, k_index, q_seg, k_seg)
    return jnp.where(mask, s_BKGTT, MASKED), mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, block):
    o_BSHd, _ = _flash_forward(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, block)
    return o_BSHd


def _flash_forward(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, block):
    B, S, H, d = q_BSHd.shape
    K = k_BSKd.shape[2]
    scale = d**-0.5
    q_BnTKGd = blocks(group_queries(q_BSHd, K), block)
    k_BnTKd, v_BnTKd = blocks(k_BSKd, block), blocks(v_BSKd, block)
    seg_BnT = None if segment_ids_BS is None else blocks(segment_ids_BS, block)

    def query_block(i):
        q_BTKGd = q_BnTKGd[:, i]
        # zeros_like(q...) rather than zeros: inside shard_map a loop carry must
        # vary over the mesh axes its inputs vary over.
        stats_BKGT = jnp.zeros_like(q_BTKGd, jnp.float32, (B, K, H // K, block))  # running max / sum
        acc_BKGTd = jnp.zeros_like(q_BTKGd, jnp.float32, (B, K, H // K, block, d))

        def key_block(j, carry):
            m_BKGT, l_BKGT, acc_BKGTd = carry
            s_BKGTT, mask = _block_scores(q_BTKGd, k_BnTKd[:, j], i, j, seg_BnT, block, scale)
            m_new = jnp.maximum(m_BKGT, s_BKGTT.max(-1))
            p_BKGTT = jnp.where(mask, jnp.exp(s_BKGTT - m_new[..., None]), 0.0)
            correction = jnp.exp(m_BKGT - m_new)
            l_BKGT = l_BKGT * correction + p_BKGTT.sum(-1)
            pv_BKGTd = jnp.einsum("bkgqs,bskd->bkgqd", p_BKGTT.astype(v_BSKd.dtype), v_BnTKd[:, j],
                                  preferred_element_type=jnp.float32)
            return m_new, l_BKGT, acc_BKGTd * correction[..., None] + pv_BKGTd

        m0 = stats_BKGT + MASKED
        m_BKGT, l_BKGT, acc_BKGTd = jax.lax.fori_loop(0, i + 1, key_block, (m0, stats_BKGT, acc_BKGTd))
        o_BKGTd = acc_BKGTd / l_BKGT[..., None]
        return rearrange(o_BKGTd, "b k g q d -> b q (k g) d").astype(q_BSHd.dtype), m_BKGT + jnp.log(l_BKGT)

    o_nBTHd, lse_nBKGT = jax.lax.map(query_block, jnp.arange(S // block))
    o_BSHd = checkpoint_name(rearrange(o_nBTHd, "n b q h d -> b (n q) h d"), ATTENTION_OUT)
    lse_nBKGT = checkpoint_name(lse_nBKGT, ATTENTION_LSE)
    return o_BSHd, (q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, o_BSHd, lse_nBKGT)


def _flash_backward(block, residuals, do_BSHd):
    q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, o_BSHd, lse_nBKGT = residuals
    B, S, H, d = q_BSHd.shape
    K = k_BSKd.shape[2]
    n = S // block
    scale = d**-0.5
    q_BnTKGd = blocks(group_queries(q_BSHd, K), block)
    do_BnTKGd = blocks(group_queries(do_BSHd, K), block)
    k_BnTKd, v_BnTKd = blocks(k_BSKd, block), blocks(v_BSKd, block)
    seg_BnT = None if segment_ids_BS is None else blocks(segment_ids_BS, block)
    # delta_i = rowsum(dO_i * O_i): the softmax Jacobian's correction term.
    delta_BSH = jnp.sum(do_BSHd.astype(jnp.float32) * o_BSHd.astype(jnp.float32), axis=-1)
    delta_nBKGT = rearrange(delta_BSH, "b (n q) (k g) -> n b k g q", n=n, k=K)

    def probs_and_dscores(i, j):
        s_BKGTT, mask = _block_scores(q_BnTKGd[:, i], k_BnTKd[:, j], i, j, seg_BnT, block, scale)
        p_BKGTT = jnp.where(mask, jnp.exp(s_BKGTT - lse_nBKGT[i][..., None]), 0.0)
        dp_BKGTT = jnp.einsum("bqkgd,bskd->bkgqs", do_BnTKGd[:, i], v_BnTKd[:, j], preferred_element_type=jnp.float32)
        return p_BKGTT, p_BKGTT * (dp_BKGTT - delta_nBKGT[i][..., None])

    def dq_block(i):
        def step(j, dq_BTKGd):
            _, ds_BKGTT = probs_and_dscores(i, j)
            return dq_BTKGd + jnp.einsum("bkgqs,bskd->bqkgd", ds_BKGTT, k_BnTKd[:, j].astype(jnp.float32))

        dq_BTKGd = jax.lax.fori_loop(0, i + 1, step, jnp.zeros_like(q_BnTKGd[:, 0], jnp.float32))
        return dq_BTKGd * scale

    def dkv_block(j):
        def step(i, carry):
            dk_BTKd, dv_BTKd = carry
            p_BKGTT, ds_BKGTT = probs_and_dscores(i, j)
            dv_BTKd = dv_BTKd + jnp.einsum("bkgqs,bqkgd->bskd", p_BKGTT, do_BnTKGd[:, i].astype(jnp.float32))
            dk_BTKd = dk_BTKd + jnp.einsum("bkgqs,bqkgd->bskd", ds_BKGTT, q_BnTKGd[:, i].astype(jnp.float32))
            return dk_BTKd, dv_BTKd

        zeros_BTKd = jnp.zeros_like(k_BnTKd[:, 0], jnp.float32)
        dk_BTKd, dv_BTKd = jax.lax.fori_loop(j, n, step, (zeros_BTKd, zeros_BTKd))
        return dk_BTKd * scale, dv_BTKd

    dq_BSHd = rearrange(jax.lax.map(dq_block, jnp.arange(n)), "n b q k g d -> b (n q) (k g) d")
    dk_nBTKd, dv_nBTKd = jax.lax.map(dkv_block, jnp.arange(n))
    dk_BSKd = rearrange(dk_nBTKd, "n b s k d -> b (n s) k d")
    dv_BSKd = rearrange(dv_nBTKd, "n b s k d -> b (n s) k d")
    return dq_BSHd.astype(q_BSHd.dtype), dk_BSKd.astype(k_BSKd.dtype), dv_BSKd.astype(v_BSKd.dtype), None


_flash.defvjp(_flash_forward, _flash_backward)
