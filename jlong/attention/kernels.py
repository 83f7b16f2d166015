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

IMPLEMENTATIONS = ("auto", "cudnn", "blockwise", "reference")

# Names of the blockwise kernel's saved output and log-sum-exp, for remat
# policies that keep them (and so skip re-running the attention forward).
ATTENTION_OUT = "attention_out"
ATTENTION_LSE = "attention_lse"

# Finite stand-in for -inf, so fully masked blocks give exp(..) = 0, not NaN.
_MASKED = -1e30


def attend(q, k, v, segment_ids=None, *, impl: str = "auto", block_size: int = 512):
    """Causal attention of q [B,S,H,d] over k, v [B,S,K,d]; see the module doc."""
    if impl == "auto":
        impl = "cudnn" if cudnn_applies(q, segment_ids) else "blockwise"
    if impl == "reference":
        return reference_attention(q, k, v, segment_ids)
    if impl == "blockwise":
        return blockwise_attention(q, k, v, segment_ids, block_size=block_size)
    if impl == "cudnn":
        if segment_ids is not None:
            raise JlongError(
                "attention.impl=cudnn cannot mask packed documents (segment ids); "
                "use attention.impl=auto or blockwise"
            )
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    raise JlongError(f"attention.impl must be one of {', '.join(IMPLEMENTATIONS)}, got {impl!r}")


def cudnn_applies(q, segment_ids) -> bool:
    """Whether the cuDNN fused kernel can run these inputs on this backend."""
    kernel = choose_kernel("auto", platform=jax.default_backend(), dtype=q.dtype, seq_len=q.shape[1],
                           head_dim=q.shape[-1], packed=segment_ids is not None)
    return kernel == "cudnn"


def choose_kernel(impl: str, *, platform: str, dtype, seq_len: int, head_dim: int, packed: bool) -> str:
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


def _group_queries(q, num_kv_heads: int):
    """[B, S, H, d] -> [B, S, K, G, d]: query heads grouped by their kv head."""
    return rearrange(q, "b s (k g) d -> b s k g d", k=num_kv_heads)


def _visible(q_index, k_index, q_segments, k_segments):
    """Causal and same-segment mask, broadcast to [B, 1, 1, Tq, Tk]."""
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None, None]


def reference_attention(q, k, v, segment_ids=None):
    """Materialises the full score matrix; the ground truth for tests."""
    B, S, H, d = q.shape
    qg = _group_queries(q, k.shape[2])
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    index = jnp.arange(S)
    scores = jnp.where(_visible(index, index, segment_ids, segment_ids), scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    o = jnp.einsum("bkgqs,bskd->bqkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return rearrange(o, "b q k g d -> b q (k g) d").astype(q.dtype)


# --------------------------------------------------------------------------
# Blockwise (flash-style) attention


def blockwise_attention(q, k, v, segment_ids=None, *, block_size: int = 512):
    """Flash-style attention; S need not be a multiple of the block size."""
    S = q.shape[1]
    block = min(block_size, S)
    padded = -(-S // block) * block
    if padded != S:
        # Padding goes at the end, so causality hides it from every real query;
        # the padded queries' outputs are dropped below.
        pad = [(0, 0), (0, padded - S)]
        q, k, v = (jnp.pad(x, pad + [(0, 0), (0, 0)]) for x in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, pad, constant_values=-1)
    o = _flash(q, k, v, segment_ids, block)
    return o[:, :S]


def _blocks(x, block):
    """[B, S, ...] -> [B, S/block, block, ...]."""
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def _block_scores(q_blk, k_blk, i, j, seg, block, scale):
    """Masked scores [B, K, G, bq, bk] of query block i against key block j."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
    q_index = i * block + jnp.arange(block)
    k_index = j * block + jnp.arange(block)
    q_seg = k_seg = None
    if seg is not None:
        q_seg, k_seg = seg[:, i], seg[:, j]
    mask = _visible(q_index, k_index, q_seg, k_seg)
    return jnp.where(mask, s, _MASKED), mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, block):
    o, _ = _flash_forward(q, k, v, segment_ids, block)
    return o


def _flash_forward(q, k, v, segment_ids, block):
    B, S, H, d = q.shape
    K = k.shape[2]
    scale = d**-0.5
    qb = _blocks(_group_queries(q, K), block)  # [B, n, bq, K, G, d]
    kb, vb = _blocks(k, block), _blocks(v, block)  # [B, n, bk, K, d]
    seg = None if segment_ids is None else _blocks(segment_ids, block)

    def query_block(i):
        q_blk = qb[:, i]
        # zeros_like(q...) rather than zeros: inside shard_map a loop carry must
        # vary over the mesh axes its inputs vary over.
        stats = jnp.zeros_like(q_blk, jnp.float32, (B, K, H // K, block))  # running max / sum
        acc = jnp.zeros_like(q_blk, jnp.float32, (B, K, H // K, block, d))

        def key_block(j, carry):
            m, l, acc = carry
            s, mask = _block_scores(q_blk, kb[:, j], i, j, seg, block, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            l = l * correction + p.sum(-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb[:, j],
                            preferred_element_type=jnp.float32)
            return m_new, l, acc * correction[..., None] + pv

        m0 = stats + _MASKED
        m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, (m0, stats, acc))
        o = acc / l[..., None]
        return rearrange(o, "b k g q d -> b q (k g) d").astype(q.dtype), m + jnp.log(l)

    o, lse = jax.lax.map(query_block, jnp.arange(S // block))
    o = checkpoint_name(rearrange(o, "n b q h d -> b (n q) h d"), ATTENTION_OUT)
    lse = checkpoint_name(lse, ATTENTION_LSE)
    return o, (q, k, v, segment_ids, o, lse)  # lse: [n, B, K, G, bq]


def _flash_backward(block, residuals, do):
    q, k, v, segment_ids, o, lse = residuals
    B, S, H, d = q.shape
    K = k.shape[2]
    n = S // block
    scale = d**-0.5
    qb = _blocks(_group_queries(q, K), block)
    dob = _blocks(_group_queries(do, K), block)
    kb, vb = _blocks(k, block), _blocks(v, block)
    seg = None if segment_ids is None else _blocks(segment_ids, block)
    # delta_i = rowsum(dO_i * O_i): the softmax Jacobian's correction term.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    delta = rearrange(delta, "b (n q) (k g) -> n b k g q", n=n, k=K)

    def probs_and_dscores(i, j):
        s, mask = _block_scores(qb[:, i], kb[:, j], i, j, seg, block, scale)
        p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", dob[:, i], vb[:, j], preferred_element_type=jnp.float32)
        return p, p * (dp - delta[i][..., None])

    def dq_block(i):
        def step(j, dq):
            _, ds = probs_and_dscores(i, j)
            return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb[:, j].astype(jnp.float32))

        dq = jax.lax.fori_loop(0, i + 1, step, jnp.zeros_like(qb[:, 0], jnp.float32))
        return dq * scale

    def dkv_block(j):
        def step(i, carry):
            dk, dv = carry
            p, ds = probs_and_dscores(i, j)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p, dob[:, i].astype(jnp.float32))
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb[:, i].astype(jnp.float32))
            return dk, dv

        zeros = jnp.zeros_like(kb[:, 0], jnp.float32)
        dk, dv = jax.lax.fori_loop(j, n, step, (zeros, zeros))
        return dk * scale, dv

    dq = rearrange(jax.lax.map(dq_block, jnp.arange(n)), "n b q k g d -> b (n q) (k g) d")
    dk, dv = jax.lax.map(dkv_block, jnp.arange(n))
    dk = rearrange(dk, "n b s k d -> b (n s) k d")
    dv = rearrange(dv, "n b s k d -> b (n s) k d")
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_forward, _flash_backward)
