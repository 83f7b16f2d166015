"""cuDNN's fused attention calls emulated in plain XLA, from the arrays
jlong hands them (`jlong.attention.cudnn.fused_forward/fused_backward`).

Written from cuDNN's documented contract, independently of jlong's code:
segment c (of the B*M listed) covers queries [q_offsets[c] / (H*d), + q_seqlen[c])
and keys [kv_offsets[c] / (K*d), + kv_seqlen[c]] of the flattened batch, top-left
causal within the segment under a causal mask, and with a sliding window of w
a query at position p sees keys at positions above p - w (the left diagonal
bound, top-left aligned within the segment); statistics [B*M, H, T] hold
segment c's query p at [c, :, p]. What cuDNN leaves unwritten (rows outside
every segment, statistics past a segment's end) comes back NaN here, so a
caller that reads it fails the tests. Offsets not on a token boundary of their
own tensor (a kv offset scaled by the query heads, say) poison everything.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _layout(q, k, ragged):
    """Per flattened token: segment (-1: none) and position in it, for queries and keys; and M."""
    B, T, H, d = q.shape
    S, K = k.shape[1], k.shape[2]
    if ragged is None:  # one segment per row
        q_seqlen, kv_seqlen = jnp.full(B, T), jnp.full(B, S)
        q_offsets, kv_offsets = jnp.arange(B) * T * H * d, jnp.arange(B) * S * K * d
    else:
        q_seqlen, kv_seqlen = ragged.q_seqlen.reshape(-1), ragged.kv_seqlen.reshape(-1)
        q_offsets, kv_offsets = ragged.q_offsets.reshape(-1), ragged.kv_offsets.reshape(-1)
    segments = q_seqlen.shape[0]
    aligned = jnp.all(q_offsets % (H * d) == 0) & jnp.all(kv_offsets % (K * d) == 0)

    def tokens(offsets, seqlen, stride, count):
        seg, pos = jnp.full(count, -1), jnp.zeros(count, jnp.int32)
        flat = jnp.arange(count)
        for c in range(segments):
            start = offsets[c] // stride
            inside = (flat >= start) & (flat < start + seqlen[c]) & (seqlen[c] > 0)
            seg, pos = jnp.where(inside, c, seg), jnp.where(inside, flat - start, pos)
        return seg, pos

    q_seg, q_pos = tokens(q_offsets, q_seqlen, H * d, B * T)
    k_seg, k_pos = tokens(kv_offsets, kv_seqlen, K * d, B * S)
    return q_seg, q_pos, k_seg, k_pos, segments, aligned


def _probabilities(q, k, ragged, mask, scale, lse=None, window=None):
    """Masked scores' softmax [K, G, BT, BS] (from `lse` [BT, K, G] if given), the visibility, the layout."""
    B, T, H, d = q.shape
    S, K = k.shape[1], k.shape[2]
    q_seg, q_pos, k_seg, k_pos, segments, aligned = _layout(q, k, ragged)
    visible = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] >= 0)
    if "CAUSAL" in mask:
        visible &= q_pos[:, None] >= k_pos[None, :]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    qf = q.reshape(B * T, K, H // K, d).astype(jnp.float32)
    kf = k.reshape(B * S, K, d).astype(jnp.float32)
    s = jnp.einsum("qkgd,skd->kgqs", qf, kf) * scale
    s = jnp.where(visible, s, -jnp.inf)
    if lse is None:
        lse = jax.scipy.special.logsumexp(s, axis=-1)  # [K, G, BT]
    p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)
    poison = jnp.where(aligned, 0.0, jnp.nan)
    return p + poison, lse, (q_seg, q_pos, k_seg, segments)


def emulated_forward(q, k, v, ragged, mask, scale, window=None):
    B, T, H, d = q.shape
    S, K = k.shape[1], k.shape[2]
    p, lse, (q_seg, q_pos, _, segments) = _probabilities(q, k, ragged, mask, scale, window=window)
    o = jnp.einsum("kgqs,skd->qkgd", p, v.reshape(B * S, K, d).astype(jnp.float32)).reshape(B * T, H, d)
    covered = q_seg >= 0
    o = jnp.where(covered[:, None, None], o, jnp.nan).reshape(B, T, H, d).astype(q.dtype)
    lse_TH = lse.reshape(H, B * T).T
    stats = jnp.full((segments, H, T), jnp.nan, jnp.float32)
    stats = stats.at[jnp.where(covered, q_seg, segments), :, q_pos].set(lse_TH, mode="drop")
    return o, stats


def emulated_backward(q, k, v, ragged, mask, scale, stats, o, do, window=None):
    B, T, H, d = q.shape
    K = k.shape[2]
    q_seg, q_pos, k_seg, _, _, _ = _layout(q, k, ragged)
    covered = q_seg >= 0
    lse_TH = jnp.where(covered[:, None], stats[jnp.maximum(q_seg, 0), :, q_pos], 0.0)
    lse = lse_TH.T.reshape(K, H // K, B * T)
    p, _, _ = _probabilities(q, k, ragged, mask, scale, lse, window)
    f32 = lambda x, heads: x.reshape(-1, heads, d).astype(jnp.float32)  # noqa: E731
    dof, of = f32(do, H).reshape(B * T, K, H // K, d), f32(o, H).reshape(B * T, K, H // K, d)
    qf, kf, vf = f32(q, H).reshape(B * T, K, H // K, d), f32(k, K), f32(v, K)
    delta = jnp.einsum("qkgd,qkgd->kgq", dof, of)
    dp = jnp.einsum("qkgd,skd->kgqs", dof, vf)
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("kgqs,skd->qkgd", ds, kf).reshape(B * T, H, d) * scale
    dk = jnp.einsum("kgqs,qkgd->skd", ds, qf) * scale
    dv = jnp.einsum("kgqs,qkgd->skd", p, dof)
    dq = jnp.where(covered[:, None, None], dq, jnp.nan).reshape(q.shape)
    k_covered = (k_seg >= 0)[:, None, None]
    dk, dv = (jnp.where(k_covered, x, jnp.nan).reshape(k.shape) for x in (dk, dv))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def emulate_cudnn(monkeypatch):
    """Puts the emulation in place of the two cuDNN calls."""
    from jlong.attention import cudnn

    monkeypatch.setattr(cudnn, "fused_forward", emulated_forward)
    monkeypatch.setattr(cudnn, "fused_backward", emulated_backward)
