"""The attention block's test cases: small models and inputs, the textbook
single-device block to compare with, and the block run on a mesh."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from helpers import leaf_at

from jlong.attention.kernels import AttentionKernel, reference_attention
from jlong.config import ModelConfig
from jlong.ops.layers import apply_rope, rms_norm, rope_inverse_frequencies
from jlong.ops.shards import HIDDEN, TOKENS
from jlong.families import blocks
from jlong.model.transformer import ForwardOptions
from jlong.parallel.placement import MeshShards, compute_sharding, make_mesh
from jlong.ops.zigzag import SequenceLayout


def attention_model(H, K, qkv_extras=False):
    return ModelConfig(
        vocab_size=16, hidden_size=64, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=H, num_key_value_heads=K, head_dim=8, rope_theta=500.0,
        attention_bias=qkv_extras, qk_norm=qkv_extras,
    )


def attention_params(model, seed=0):
    D, H, K, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dim_per_head
    shapes = {"attn_norm": (D,), "wq": (D, H, d), "wk": (D, K, d), "wv": (D, K, d), "wo": (H, d, D)}
    if model.attention_bias:
        shapes.update(bq=(H, d), bk=(K, d), bv=(K, d))
    if model.qk_norm:
        shapes.update(q_norm=(d,), k_norm=(d,))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    scale = {name: 0.1 if name.endswith("norm") or name.startswith("b") else D**-0.5 for name in shapes}
    return {
        name: scale[name] * jax.random.normal(key, shape) + (1.0 if name.endswith("norm") else 0.0)
        for (name, shape), key in zip(shapes.items(), keys)
    }


def plain_attention_block(p, x, positions, segment_ids, model):
    """The textbook x + attention(norm(x)), written out independently of jlong's stages."""
    h = rms_norm(x, p["attn_norm"], model.rms_norm_eps)
    q = jnp.einsum("bsd,dhk->bshk", h, p["wq"])
    k = jnp.einsum("bsd,dhk->bshk", h, p["wk"])
    v = jnp.einsum("bsd,dhk->bshk", h, p["wv"])
    if model.attention_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if model.qk_norm:
        q, k = rms_norm(q, p["q_norm"], model.rms_norm_eps), rms_norm(k, p["k_norm"], model.rms_norm_eps)
    inv_freq = rope_inverse_frequencies(model)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    o = reference_attention(q, k, v, segment_ids)
    return x + jnp.einsum("bshk,hkd->bsd", o, p["wo"])


def attention_inputs(model, batch=4, seq=64, packed=False, seed=1):
    x = jax.random.normal(jax.random.PRNGKey(seed), (batch, seq, model.hidden_size))
    cotangent = jax.random.normal(jax.random.PRNGKey(seed + 1), x.shape)
    if not packed:
        positions = np.broadcast_to(np.arange(seq), (batch, seq))
        return x, cotangent, np.array(positions, np.int32), None
    # Documents of uneven lengths, restarting positions at each boundary.
    rng = np.random.default_rng(seed)
    segments = np.cumsum(rng.random((batch, seq)) < 0.08, axis=1).astype(np.int32)
    positions = np.zeros((batch, seq), np.int32)
    for b, t in itertools.product(range(batch), range(1, seq)):
        positions[b, t] = 0 if segments[b, t] != segments[b, t - 1] else positions[b, t - 1] + 1
    return x, cotangent, positions, segments


def value_and_grads(block, params, x, positions, segment_ids, cotangent):
    out, pullback = jax.vjp(lambda p, x: block(p, x, positions, segment_ids), params, x)
    return out, *pullback(cotangent)


def reference_block(model, params, inputs):
    x, cotangent, positions, segment_ids = inputs
    block = lambda p, x, pos, seg: plain_attention_block(p, x, pos, seg, model)  # noqa: E731
    return jax.jit(value_and_grads, static_argnums=0)(block, params, x, positions, segment_ids, cotangent)


def sharded_block(model, params, inputs, mesh_config, heads_per_stage, impl="blockwise"):
    """The attention block on a mesh of all devices. With a ring, the inputs
    are laid out zigzag and the results restored to sequence order."""
    x, cotangent, positions, segment_ids = inputs
    mesh = make_mesh(mesh_config, jax.devices())
    layout = SequenceLayout(mesh_config.ring)
    # mlp_tile: the normed projections run in tiles of 4 of each shard's 8+ tokens.
    options = ForwardOptions(
        shards=MeshShards(mesh), attention=AttentionKernel(impl, 16),
        head_stages=model.num_attention_heads // heads_per_stage, mlp_tile=4,
    )
    tokens, hidden = compute_sharding(mesh, TOKENS), compute_sharding(mesh, HIDDEN)
    block = lambda p, x, pos, seg: blocks.attention(p, x, pos, seg, model, options)  # noqa: E731
    placed = [jax.device_put(layout.lay_out(x), hidden), jax.device_put(layout.lay_out(positions), tokens),
              None if segment_ids is None else jax.device_put(layout.lay_out(segment_ids), tokens),
              jax.device_put(layout.lay_out(cotangent), hidden)]
    out, d_params, d_x = jax.jit(value_and_grads, static_argnums=0)(block, params, *placed)
    return layout.restore(out), d_params, layout.restore(d_x)


def assert_block_close(got, want):
    """Within 1e-5 relative, elementwise or against the array's largest value
    (float32 sums in a different order differ by more than 1e-5 near zero)."""
    names = ["output", "d_params", "d_x"]
    for name, g, w in zip(names, got, want):
        for path, w_leaf in jax.tree_util.tree_leaves_with_path(w):
            g_leaf = np.asarray(leaf_at(g, path))
            atol = 1e-5 * float(np.abs(w_leaf).max())
            np.testing.assert_allclose(g_leaf, w_leaf, rtol=1e-5, atol=atol, err_msg=name + jax.tree_util.keystr(path))
