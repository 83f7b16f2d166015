"""Multi-head latent attention's projections (DeepSeek-V2 and V3, GLM-4.7-Flash,
Moonlight): per-head queries, keys and values made from low-rank latents.

From the normed input h (RMSNorm with `attn_norm`):

- queries: h @ `wq` [D, H, dq] directly (V2-Lite), or through a compressed
  query, RMSNorm(h @ `wq_a` [D, Rq], `q_a_norm`) @ `wq_b` [Rq, H, dq];
- keys and values: h @ `wkv_a` [D, Rkv + dr] gives the compressed latent c
  (its first Rkv columns, normed with `kv_a_norm`) and one rotary key k_r
  [dr] every head shares; c @ `wkv_b` [Rkv, H, dn + dv] gives each head's key
  without rotary embedding, k_n [dn], and its value [dv];
- each head's query is [q_n, RoPE(q_r)] and its key [k_n, RoPE(k_r)], of
  dq = dn + dr dimensions; its value has dv of its own.

So the attention that follows is multi-head attention over H heads of keys
and values (K = H), with values of their own head size: every
sequence-parallel method and kernel runs it unchanged, each head stage
projecting the heads it attends (`LatentProjection.qkv` has
`QKVProjection.qkv`'s interface), and the output projection is the usual
`wo` [H, dv, D] (`jlong.attention.projection.project_out`). Each stage
recomputes the latents of its tokens (a D x (Rq + Rkv + dr) matmul) before
up-projecting its own heads.

Rotary embedding is jlong's (`apply_rope`: the two halves of the rotary
dimensions); the checkpoints' interleaved pairs are reordered into halves as
the weights are read (`jlong.families.deepseek`). The softmax scale is
dq^-1/2 times YaRN's correction (`query_scale`, mscale_all_dim's square);
RoPE's cos and sin carry YaRN's attention factor (`rope_scale`).

The latents' norms take transformers' epsilon for them, 1e-6, whatever the
model's `rms_norm_eps` (which the input's norm takes).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jlong.ops import adapted
from jlong.ops.layers import apply_rope, rms_norm
from jlong.ops.tiling import tiles_gradient_into, varying_like

LATENT_PARAMS = ("attn_norm", "wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo")
LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default


@dataclasses.dataclass(frozen=True)
class LatentProjection:
    """How per-head q, k, v are made from the residual stream x through the
    latents (see the module doc). `qk_nope_head_dim` (dn) and `kv_lora_rank`
    (Rkv) split the up-projections; the rest is read from the weights'
    shapes. `one_head_size` pads the heads to one size for the callers that
    take no value head size of its own: q and k with zeros (q scaled so
    that the kernels' (padded size)^-1/2 is the softmax scale of dq), v with
    zeros, and `wo` with zero rows (`padded_output`)."""

    norm_eps: float  # the input's RMSNorm
    rope_inv_freq: tuple[float, ...]  # [dr / 2]
    qk_nope_head_dim: int
    kv_lora_rank: int
    rope_scale: float = 1.0  # YaRN's attention factor on cos and sin
    query_scale: float = 1.0  # the softmax scale over dq^-1/2 (YaRN's mscale_all_dim correction)
    tile: int = 0  # tokens projected at a time; 0 = the whole shard at once
    one_head_size: bool = False
    sinks: bool = False  # what the sequence-parallel methods read of a projection: none here
    output_bias: bool = False

    def sink_logits(self, p, first, count):
        return None

    def qkv(self, p, x_BSD, positions_BS, q_heads, kv_heads, sink_BSD):
        """(q [B, S, count, dq] of query heads `q_heads` = (first, count), k [B, S, count, dq] and
        v [B, S, count, dv] of `kv_heads`, None (no output gate), the sink, through which x's
        gradient flows as `QKVProjection.qkv`'s does)."""
        q_name = "wq" if "wq" in p else "wq_b"
        weights = {
            "norm": p["attn_norm"], "kv_a": p["wkv_a"], "kv_a_norm": p["kv_a_norm"],
            "q": adapted.on_outputs(functools.partial(_head_range, heads=q_heads), p[q_name]),
            "kv_b": adapted.on_outputs(functools.partial(_head_range, heads=kv_heads), p["wkv_b"]),
        }
        if q_name == "wq_b":
            weights.update(q_a=p["wq_a"], q_a_norm=p["q_a_norm"])
        tile, weights = self.tile or x_BSD.shape[1], varying_like(weights, x_BSD)
        (q, k, v), sink_BSD = tiles_gradient_into(self._project, tile, weights, x_BSD, positions_BS, sink_BSD)
        return q, k, v, None, sink_BSD

    def _project(self, w, x_BSD, positions_BS):
        h_BSD = rms_norm(x_BSD, w["norm"], self.norm_eps)
        if "q_a" in w:
            h_q = rms_norm(adapted.matmul(h_BSD, w["q_a"], inputs=1), w["q_a_norm"], LATENT_NORM_EPS)
            q_BSNd = adapted.matmul(h_q, w["q"], inputs=1)
        else:
            q_BSNd = adapted.matmul(h_BSD, w["q"], inputs=1)
        kv_a_BSL = adapted.matmul(h_BSD, w["kv_a"], inputs=1)
        c_BSR = rms_norm(kv_a_BSL[..., :self.kv_lora_rank], w["kv_a_norm"], LATENT_NORM_EPS)
        kv_BSNe = adapted.matmul(c_BSR, w["kv_b"], inputs=1)
        dn = self.qk_nope_head_dim
        rotate = functools.partial(apply_rope, positions_BS=positions_BS,
                                   inv_freq=np.asarray(self.rope_inv_freq, np.float32), scale=self.rope_scale)
        k_rope_BS1r = rotate(kv_a_BSL[..., self.kv_lora_rank:][:, :, None, :])
        q = jnp.concatenate([q_BSNd[..., :dn], rotate(q_BSNd[..., dn:])], axis=-1)
        k_rope = jnp.broadcast_to(k_rope_BS1r, (*kv_BSNe.shape[:3], k_rope_BS1r.shape[-1]))
        k, v = jnp.concatenate([kv_BSNe[..., :dn], k_rope], axis=-1), kv_BSNe[..., dn:]
        scale = self.query_scale
        if self.one_head_size and (size := max(q.shape[-1], v.shape[-1])) > q.shape[-1]:
            scale *= (size / q.shape[-1]) ** 0.5
            q, k = _padded(q, size), _padded(k, size)
        if scale != 1.0:
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
        if self.one_head_size:
            v = _padded(v, q.shape[-1])
        return q, k, v

    def padded_output(self, p):
        """The attention weights with `wo` [H, dv, D] given zero rows up to the heads' one size
        (`one_head_size`); unchanged otherwise."""
        if not self.one_head_size:
            return p
        q_name = "wq" if "wq" in p else "wq_b"
        size = max(p[q_name].shape[-1], p["wo"].shape[1])
        rows = functools.partial(jnp.pad, pad_width=((0, 0), (0, size - p["wo"].shape[1]), (0, 0)))
        return {**p, "wo": adapted.on_inputs(rows, p["wo"])}


def _head_range(w, heads):
    """Heads [first, first + count) of an up-projection [in, H, d] (a traced `first` too)."""
    first, count = heads
    return w if count == w.shape[1] else jax.lax.dynamic_slice_in_dim(w, first, count, axis=1)


def _padded(x, size: int):
    """x with its last axis zero-padded to `size`."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])
