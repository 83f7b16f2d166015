"""Attention's projections of a sequence shard: the normed input to q, k, v
for a range of heads, and a range of heads' output back through Wo.

The model describes its projection (`QKVProjection`: norm epsilon, biases,
per-head q/k norm, RoPE frequencies) and hands over its attention weights
by name: `attn_norm`, `wq` [D, H, d], `wk`, `wv` [D, K, d], `wo` [H, d, D],
and with the description's options `bq`, `bk`, `bv` and `q_norm`, `k_norm`.
With an output gate (Qwen3.5), `wq` is [D, H, 2d]: each head's query rows
followed by its gate rows, as Hugging Face's q_proj keeps them; the heads'
attention output is multiplied by sigmoid(gate) before Wo.

GPT-OSS adds two: `attn_sinks` [H], one sink logit per query head in every
softmax's denominator (`jlong.attention.sinks`; the methods hand each
attention call its heads' logits, `QKVProjection.sink_logits`), and `bo`
[D], Wo's bias, added once per token after the head stages' sum
(`add_output_bias`).

The input's gradient never flows through the projection's own output: each
call takes a gradient sink and adds its part of x's gradient into the sink's
gradient in place (`tiles_gradient_into`). The UPipe stages pass one sink
along, so the stages' gradients of x add up in one [B, s, D] buffer per device.
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

ATTENTION_PARAMS = ("attn_norm", "wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm", "attn_sinks", "bo")


@dataclasses.dataclass(frozen=True)
class QKVProjection:
    """How q, k, v are made from the residual stream x: RMSNorm(x) with
    `attn_norm`, one matmul for q, k and v, then the optional bias, the
    optional per-head RMSNorm of q and k, and RoPE at the tokens' positions."""

    norm_eps: float
    rope_inv_freq: tuple[float, ...]  # per-pair rotation rates [head_dim / 2]
    rope_scale: float = 1.0  # what RoPE's cos and sin are multiplied by (YaRN's attention factor)
    # What q is multiplied by after RoPE, for a softmax scale other than the kernels' head_dim^-1/2
    # (Gemma's query_pre_attn_scalar^-1/2 = query_scale x head_dim^-1/2).
    query_scale: float = 1.0
    bias: bool = False
    qk_norm: bool = False
    output_gate: bool = False  # wq also makes a gate per query head and dimension (`project_out` applies it)
    tile: int = 0  # tokens projected at a time; 0 = the whole shard at once
    sinks: bool = False  # attention sinks: `attn_sinks` [H] (`sink_logits`)
    output_bias: bool = False  # Wo's bias `bo` [D] (`add_output_bias`)

    def sink_logits(self, p, first, count):
        """The sink logits [count] of query heads [first, first + count) (a
        traced `first` too), in float32; None without sinks."""
        if not self.sinks:
            return None
        return _heads(p["attn_sinks"], first, count, axis=0).astype(jnp.float32)

    latent_width = 0  # keys and values have no narrower per-token form to move (`jlong.attention.latent`)

    def moves_latent(self, p, heads: int) -> bool:
        """Whether keys and values travel as a per-token latent (`jlong.attention.latent`): never here."""
        return False

    def qkv(self, p, x_BSD, positions_BS, q_heads, kv_heads, sink_BSD):
        """(q, k, v, gate, sink): q for the query heads `q_heads` = (first,
        count), k and v for `kv_heads`, each [B, S, count, d]; the output gate
        of the query heads, like q (None without one); the sink passes through
        unchanged and its gradient collects x's."""
        ranges = {"q": q_heads, "k": kv_heads, "v": kv_heads}
        matrices = {name: adapted.on_outputs(functools.partial(_heads, first=heads[0], count=heads[1], axis=1),
                                             p[f"w{name}"]) for name, heads in ranges.items()}
        if self.output_gate:  # [D, U, 2d] -> [D, 2U, d]: each head's query, then its gate
            _, U, d2 = matrices["q"].shape
            matrices["q"] = adapted.on_outputs(lambda w: w.reshape(w.shape[0], 2 * U, d2 // 2), matrices["q"])
            ranges["q"] = (q_heads[0], 2 * q_heads[1])
        weights = {"norm": p["attn_norm"], "qkv": adapted.concatenate(list(matrices.values()), axis=1)}
        if self.bias:
            weights["bias"] = jnp.concatenate([_heads(p[f"b{name}"], *heads, axis=0) for name, heads in ranges.items()])
        if self.qk_norm:
            weights.update(q_norm=p["q_norm"], k_norm=p["k_norm"])
        counts = tuple(heads[1] for heads in ranges.values())
        normed_qkv = functools.partial(self._normed_qkv, counts=counts)
        tile, weights = self.tile or x_BSD.shape[1], varying_like(weights, x_BSD)
        qkv, sink_BSD = tiles_gradient_into(normed_qkv, tile, weights, x_BSD, positions_BS, sink_BSD)
        return *qkv, sink_BSD

    def _normed_qkv(self, w, x_BSD, positions_BS, *, counts):
        qkv_BSNd = _project(rms_norm(x_BSD, w["norm"], self.norm_eps), w["qkv"])
        if "bias" in w:
            qkv_BSNd = qkv_BSNd + w["bias"]
        q, k, v = jnp.split(qkv_BSNd, np.cumsum(counts)[:-1], axis=2)
        gate = None
        if self.output_gate:
            B, S, U2, d = q.shape
            q, gate = jnp.moveaxis(q.reshape(B, S, U2 // 2, 2, d), 3, 0)
        if self.qk_norm:
            q = rms_norm(q, w["q_norm"], self.norm_eps)
            k = rms_norm(k, w["k_norm"], self.norm_eps)
        inv_freq = np.asarray(self.rope_inv_freq, np.float32)
        rotate = functools.partial(apply_rope, positions_BS=positions_BS, inv_freq=inv_freq, scale=self.rope_scale)
        q = rotate(q)
        if self.query_scale != 1.0:
            q = (q.astype(jnp.float32) * self.query_scale).astype(q.dtype)
        return q, rotate(k), v, gate


def project_out(p, o_BSHd, first, count, gate_BSHd=None):
    """o [B, S, count, d] of heads [first, first + count) through Wo: [B, S, D];
    times sigmoid(gate) first when the projection made a gate."""
    if gate_BSHd is not None:
        o_BSHd = (o_BSHd.astype(jnp.float32) * jax.nn.sigmoid(gate_BSHd.astype(jnp.float32))).astype(o_BSHd.dtype)
    wo = adapted.on_inputs(functools.partial(_heads, first=first, count=count, axis=0), p["wo"])
    return adapted.matmul(o_BSHd, wo, inputs=2)


def add_output_bias(projection: QKVProjection, p, y_BsD):
    """y + bo with the projection's output bias (y unchanged without one): once
    per token, after the head stages' sum. Its gradient sums in float32."""
    if not projection.output_bias:
        return y_BsD
    return _add_bias(y_BsD, varying_like(p["bo"], y_BsD))


@jax.custom_vjp
def _add_bias(y_BsD, b_D):
    return y_BsD + b_D.astype(y_BsD.dtype)


def _add_bias_forward(y_BsD, b_D):
    return _add_bias(y_BsD, b_D), b_D


def _add_bias_backward(b_D, dy_BsD):
    return dy_BsD, jnp.sum(dy_BsD, axis=(0, 1), dtype=jnp.float32).astype(b_D.dtype)


_add_bias.defvjp(_add_bias_forward, _add_bias_backward)


def _project(x_BSD, w_DNd):
    """x @ w: [B, S, D] x [D, N, d] -> [B, S, N, d] (w may carry adapters)."""
    return adapted.matmul(x_BSD, w_DNd, inputs=1)


def _heads(w, first, count, axis):
    if count == w.shape[axis]:
        return w
    return jax.lax.dynamic_slice_in_dim(w, first, count, axis)
