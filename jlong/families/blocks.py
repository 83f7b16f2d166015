"""Pieces that decoder blocks are built from: the attention block over a
sequence-parallel mesh, the SwiGLU MLP, a mixture of SwiGLU experts, RMSNorm
over the residual stream.

Each takes the layer's parameters by name, the model config and the forward
options (`jlong.model.transformer.ForwardOptions`: shards, kernel, head
stages, tiles), and keeps [B, S, D] in the model's layout.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from jlong.attention.projection import ATTENTION_PARAMS, QKVProjection
from jlong.moe.experts import MixtureOfExperts
from jlong.ops.layers import rms_norm, rope_attention_factor, rope_inverse_frequencies, swiglu
from jlong.ops.tiling import per_sequence_tile

SWIGLU_PARAMS = ("mlp_norm", "w_gate", "w_up", "w_down")


def projection_of(model, tile: int = 0) -> QKVProjection:
    """The q, k, v projection a model's config describes (a family with
    per-layer RoPE or another softmax scale replaces fields of it)."""
    return QKVProjection(
        norm_eps=model.rms_norm_eps,
        rope_inv_freq=tuple(rope_inverse_frequencies(model).tolist()),
        rope_scale=rope_attention_factor(model),
        bias=model.attention_bias,
        qk_norm=model.qk_norm,
        tile=tile,
    )


def attention(p, x_BSD, positions_BS, segment_ids_BS, model, options, *, add_to_input: bool = True,
              projection: QKVProjection | None = None):
    """Self-attention of norm(x) with its output projection, run by the
    sequence-parallel method of `options` and summed over its head stages: added into x itself (`add_to_input`: the block
    returns x + attention, with no buffer besides x), or into a buffer of
    its own (the block returns attention alone, for a family that
    normalises it before the residual add). Positions default to the
    tokens' indices in the sequence. `projection` defaults to the model's
    (`projection_of`)."""
    H = model.num_attention_heads
    projection = projection or projection_of(model, options.mlp_tile)
    return options.sequence_parallel.attention(
        {name: p[name] for name in ATTENTION_PARAMS if name in p},
        x_BSD,
        positions_BS,
        segment_ids_BS,
        projection=projection,
        heads=(H, model.kv_heads, H // options.head_stages),
        kernel=options.attention,
        shards=options.shards,
        unroll_stages=options.unroll_attention_stages,
        add_to_input=add_to_input,
    )


def residual_swiglu(p, x_BSD, model, options):
    """x + swiglu(norm(x)); with `mlp_tile`, per device over sequence tiles
    so no [tokens, intermediate] buffer spans the whole shard."""
    fn = functools.partial(_residual_swiglu, eps=model.rms_norm_eps)
    return per_sequence_tile(fn, {name: p[name] for name in SWIGLU_PARAMS}, x_BSD,
                             shards=options.shards, tile=options.mlp_tile)


def _residual_swiglu(p, x_BSD, *, eps):
    h_BSD = rms_norm(x_BSD, p["mlp_norm"], eps)
    return x_BSD + swiglu(h_BSD, p["w_gate"], p["w_up"], p["w_down"])


def residual_experts(p, x_BSD, model, moe: MixtureOfExperts, options):
    """(x + experts(norm(x)), the layer's routing statistics): `moe` on each
    device's tokens, `mlp_tile` of them at a time, with the options' grouped
    matmul (`jlong.moe.experts`).
    The statistics carry gradients when the load-balancing loss is trained."""
    moe = dataclasses.replace(moe, kernel=options.grouped_matmul, interpret=options.interpret_kernels)
    settings = {"eps": model.rms_norm_eps, "shards": options.shards, "tile": options.mlp_tile}
    statistics = moe.statistics(p, x_BSD, differentiable=options.router_aux_loss, **settings)
    return moe.residual(p, x_BSD, **settings), statistics


def offset_scale(w):
    """A norm weight kept as its offset from one (Gemma's and Qwen3.5's x * (1 + w)) as the
    scale RMSNorm multiplies by: 1 + w, in float32."""
    return 1.0 + w.astype(jnp.float32)


def sequence_norm(x_BSD, weight, model, options):
    """RMSNorm of the residual stream; with `mlp_tile`, tile by tile like the
    MLP, so its float32 intermediates never span the whole shard."""
    fn = functools.partial(_tile_norm, eps=model.rms_norm_eps)
    return per_sequence_tile(fn, weight, x_BSD, shards=options.shards, tile=options.mlp_tile)


def _tile_norm(weight, x_BSD, *, eps):
    return rms_norm(x_BSD, weight, eps)
