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

The latent (c and the rotary key, Rkv + dr values per token) is narrower
than the heads' keys and values (H x (dq + dv)), so the methods that move
keys and values between devices may move it instead (`moves_latent`):
`latent` makes it for a device's tokens, `queries` the queries alone, and
`up_projection` the keys and values of any heads from any tokens' latent.
The all-gather method gathers it once per layer; across a ring it travels
(`jlong.attention.latent_ring`).

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
        weights = {"norm": p["attn_norm"], "kv_a": p["wkv_a"], "kv_a_norm": p["kv_a_norm"],
                   "kv_b": self.up_projection(p, kv_heads)[0], **self._query_weights(p, q_heads)}
        tile, weights = self.tile or x_BSD.shape[1], varying_like(weights, x_BSD)
        project = functools.partial(self._project, size=self._one_size(p))
        (q, k, v), sink_BSD = tiles_gradient_into(project, tile, weights, x_BSD, positions_BS, sink_BSD)
        return q, k, v, None, sink_BSD

    def queries(self, p, x_BSD, positions_BS, q_heads, sink_BSD):
        """(q [B, S, count, dq] of query heads `q_heads`, None (no output gate), the sink): `qkv`'s
        queries alone, for a method that moves the latent (`latent`) rather than keys and values."""
        weights = {"norm": p["attn_norm"], **self._query_weights(p, q_heads)}
        tile, weights = self.tile or x_BSD.shape[1], varying_like(weights, x_BSD)
        project = functools.partial(self._queries_of_input, size=self._one_size(p))
        q, sink_BSD = tiles_gradient_into(project, tile, weights, x_BSD, positions_BS, sink_BSD)
        return q, None, sink_BSD

    def latent(self, p, x_BSD, positions_BS):
        """What travels instead of the heads' keys and values, per token: (c [B, S, Rkv], normed; the rotary
        key [B, S, dr], rotated at the tokens' positions). x's gradient flows through as any input's."""
        weights = {"norm": p["attn_norm"], "kv_a": p["wkv_a"], "kv_a_norm": p["kv_a_norm"]}
        tile, weights = self.tile or x_BSD.shape[1], varying_like(weights, x_BSD)
        # x passes as the gradient sink too: its gradient is the tiles' parts, added in place.
        latent, _ = tiles_gradient_into(self._latent_of_input, tile, weights, x_BSD, positions_BS, x_BSD)
        return latent

    def up_projection(self, p, kv_heads):
        """(weights, expand): expand(weights, latent) is (k [B, T, count, dq], v [B, T, count, dv]) of
        the heads `kv_heads` = (first, count), from a latent of T tokens as `latent` makes it."""
        return adapted.on_outputs(functools.partial(_head_range, heads=kv_heads), p["wkv_b"]), self._keys_values

    @property
    def latent_width(self) -> int:
        """Values per token of the latent: Rkv + dr."""
        return self.kv_lora_rank + 2 * len(self.rope_inv_freq)

    def head_width(self, p) -> int:
        """Values per token of one head's key and value: dq + dv (read from the weights' shapes, or specs')."""
        q_name = "wq" if "wq" in p else "wq_b"
        return p[q_name].shape[-1] + p["wkv_b"].shape[-1] - self.qk_nope_head_dim

    def moves_latent(self, p, heads: int) -> bool:
        """Whether moving the latent (`latent_width` values per token) moves fewer bytes than `heads`
        heads' keys and values: what a method that could move either moves."""
        return self.latent_width < heads * self.head_width(p)

    def _query_weights(self, p, q_heads):
        q_name = "wq" if "wq" in p else "wq_b"
        weights = {"q": adapted.on_outputs(functools.partial(_head_range, heads=q_heads), p[q_name])}
        if q_name == "wq_b":
            weights.update(q_a=p["wq_a"], q_a_norm=p["q_a_norm"])
        return weights

    def _one_size(self, p) -> int:
        """The heads' one size with `one_head_size` (the larger of dq and dv); 0 without."""
        if not self.one_head_size:
            return 0
        q_name = "wq" if "wq" in p else "wq_b"
        return max(p[q_name].shape[-1], p["wkv_b"].shape[-1] - self.qk_nope_head_dim)

    def _project(self, w, x_BSD, positions_BS, size):
        h_BSD = rms_norm(x_BSD, w["norm"], self.norm_eps)
        k, v = self._keys_values(w["kv_b"], self._latent(w, h_BSD, positions_BS))
        return self._queries(w, h_BSD, positions_BS, size), k, v

    def _queries_of_input(self, w, x_BSD, positions_BS, size):
        return self._queries(w, rms_norm(x_BSD, w["norm"], self.norm_eps), positions_BS, size)

    def _latent_of_input(self, w, x_BSD, positions_BS):
        return self._latent(w, rms_norm(x_BSD, w["norm"], self.norm_eps), positions_BS)

    def _rotate(self, x, positions_BS):
        return apply_rope(x, positions_BS=positions_BS, inv_freq=np.asarray(self.rope_inv_freq, np.float32),
                          scale=self.rope_scale)

    def _queries(self, w, h_BSD, positions_BS, size):
        """[q_n, RoPE(q_r)] scaled, padded to `size` (with the scale that keeps the softmax's) if wider."""
        if "q_a" in w:
            h_q = rms_norm(adapted.matmul(h_BSD, w["q_a"], inputs=1), w["q_a_norm"], LATENT_NORM_EPS)
            q_BSNd = adapted.matmul(h_q, w["q"], inputs=1)
        else:
            q_BSNd = adapted.matmul(h_BSD, w["q"], inputs=1)
        dn = self.qk_nope_head_dim
        q = jnp.concatenate([q_BSNd[..., :dn], self._rotate(q_BSNd[..., dn:], positions_BS)], axis=-1)
        scale = self.query_scale
        if size > q.shape[-1]:
            scale *= (size / q.shape[-1]) ** 0.5
            q = _padded(q, size)
        if scale != 1.0:
            q = (q.astype(jnp.float32) * scale).astype(q.dtype)
        return q

    def _latent(self, w, h_BSD, positions_BS):
        kv_a_BSL = adapted.matmul(h_BSD, w["kv_a"], inputs=1)
        c_BSR = rms_norm(kv_a_BSL[..., :self.kv_lora_rank], w["kv_a_norm"], LATENT_NORM_EPS)
        return c_BSR, self._rotate(kv_a_BSL[..., self.kv_lora_rank:][:, :, None, :], positions_BS)[:, :, 0]

    def _keys_values(self, kv_b, latent):
        """k = [c @ W_kv_b's key part, the rotary key], v = c @ its value part, per head (padded to one size
        with `one_head_size`)."""
        c_BSR, k_rope_BSr = latent
        kv_BSNe = adapted.matmul(c_BSR, kv_b, inputs=1)
        dn = self.qk_nope_head_dim
        k_rope = jnp.broadcast_to(k_rope_BSr[:, :, None, :], (*kv_BSNe.shape[:3], k_rope_BSr.shape[-1]))
        k, v = jnp.concatenate([kv_BSNe[..., :dn], k_rope], axis=-1), kv_BSNe[..., dn:]
        if self.one_head_size:
            size = max(k.shape[-1], v.shape[-1])
            k, v = _padded(k, size), _padded(v, size)
        return k, v

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
