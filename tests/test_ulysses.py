"""Ulysses/UPipe attention equals the plain single-device attention block."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaf_at

from jlong.attention.kernels import AttentionKernel, reference_attention
from jlong.attention.ulysses import StagePlan
from jlong.config import MeshConfig, ModelConfig
from jlong.model.layers import apply_rope, rms_norm, rope_inverse_frequencies
from jlong.model.transformer import ForwardOptions, attention_block
from jlong.parallel.placement import HIDDEN, TOKENS, compute_sharding, computing_on, make_mesh


@pytest.mark.parametrize(
    "H, K, C, U",
    [(H, K, C, U) for H, K in [(32, 1), (32, 2), (32, 8), (32, 32), (40, 8), (48, 4), (28, 4)]
     for C in (1, 2, 4, 8) for U in range(C, H + 1, C) if H % C == 0 and H % U == 0],
)
def test_stage_plan_gives_every_query_head_its_kv_head(H, K, C, U):
    plan = StagePlan(H, K, C, U)
    width, first, slots = plan.kv_window
    r, g, u = plan.kv_per_device, plan.local_group, plan.heads_per_device
    assert width <= K and first.min() >= 0 and (first + width).max() <= K
    for stage, c, j in itertools.product(range(plan.num_stages), range(C), range(u)):
        query_head = stage * U + c * u + j
        slot = c * r + j // g  # the attention kernel groups local heads in runs of g
        assert first[stage] + slots[stage, slot] == query_head // (H // K)


def _model(H, K, qkv_extras=False):
    return ModelConfig(
        vocab_size=16, hidden_size=64, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=H, num_key_value_heads=K, head_dim=8, rope_theta=500.0,
        attention_bias=qkv_extras, qk_norm=qkv_extras,
    )


def _params(model, seed=0):
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


def _plain_attention_block(p, x, positions, segment_ids, model):
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


def _inputs(model, batch=4, seq=64, packed=False, seed=1):
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


def _value_and_grads(block, params, x, positions, segment_ids, cotangent):
    out, pullback = jax.vjp(lambda p, x: block(p, x, positions, segment_ids), params, x)
    return out, *pullback(cotangent)


def _reference(model, params, inputs):
    x, cotangent, positions, segment_ids = inputs
    block = lambda p, x, pos, seg: _plain_attention_block(p, x, pos, seg, model)  # noqa: E731
    return jax.jit(_value_and_grads, static_argnums=0)(block, params, x, positions, segment_ids, cotangent)


def _sharded(model, params, inputs, mesh_config, heads_per_stage, impl="blockwise"):
    x, cotangent, positions, segment_ids = inputs
    mesh = make_mesh(mesh_config, jax.devices())
    # mlp_tile: the normed projections run in tiles of 4 of each shard's 8+ tokens.
    options = ForwardOptions(attention=AttentionKernel(impl, 16), heads_per_stage=heads_per_stage, mlp_tile=4)
    tokens, hidden = compute_sharding(mesh, TOKENS), compute_sharding(mesh, HIDDEN)

    def block(p, x, pos, seg):
        with computing_on(mesh):
            return attention_block(p, x, pos, seg, model, options)

    placed = [jax.device_put(x, hidden), jax.device_put(positions, tokens),
              None if segment_ids is None else jax.device_put(segment_ids, tokens),
              jax.device_put(cotangent, hidden)]
    return jax.jit(_value_and_grads, static_argnums=0)(block, params, *placed)


def _assert_close(got, want):
    """Within 1e-5 relative, elementwise or against the array's largest value
    (float32 sums in a different order differ by more than 1e-5 near zero)."""
    names = ["output", "d_params", "d_x"]
    for name, g, w in zip(names, got, want):
        for path, w_leaf in jax.tree_util.tree_leaves_with_path(w):
            g_leaf = np.asarray(leaf_at(g, path))
            atol = 1e-5 * float(np.abs(w_leaf).max())
            np.testing.assert_allclose(g_leaf, w_leaf, rtol=1e-5, atol=atol, err_msg=name + jax.tree_util.keystr(path))


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
@pytest.mark.parametrize("sp", [2, 4, 8])
def test_ulysses_stages_equal_single_device(sp, kv_heads, packed):
    """32 query heads; U in {C, 2C, H}; the rest of the 8 devices is fsdp."""
    model = _model(32, kv_heads)
    params = _params(model)
    inputs = _inputs(model, packed=packed)
    want = _reference(model, params, inputs)
    for U in (sp, 2 * sp, 32):
        got = _sharded(model, params, inputs, MeshConfig(fsdp=8 // sp, sp=sp), U)
        _assert_close(got, want)


@pytest.mark.parametrize("U", [8, 40])
def test_qwen25_14b_head_layout_on_sp8(U):
    """40 query heads over 8 kv heads: 5 query heads per kv head, on sp=8."""
    model = _model(40, 8, qkv_extras=True)
    params = _params(model)
    inputs = _inputs(model, batch=1, packed=True)
    _assert_close(_sharded(model, params, inputs, MeshConfig(sp=8), U), _reference(model, params, inputs))


def test_single_device_stages_equal_plain_attention():
    """sp = 1 runs the same stages without collectives (no mesh at all)."""
    model = _model(8, 2, qkv_extras=True)
    params = _params(model)
    x, cotangent, positions, segment_ids = inputs = _inputs(model, batch=2, packed=True)
    want = _reference(model, params, inputs)
    for U in (1, 2, 4):
        options = ForwardOptions(attention=AttentionKernel("blockwise", 16), heads_per_stage=U)
        block = lambda p, x, pos, seg: attention_block(p, x, pos, seg, model, options)  # noqa: E731
        got = jax.jit(_value_and_grads, static_argnums=0)(block, params, x, positions, segment_ids, cotangent)
        _assert_close(got, want)


def test_stage_remat_keeps_the_cudnn_forward():
    """Traced on CPU: under the stage policy the backward pass reuses the
    fused forward's output instead of running cuDNN's forward kernel a
    second time."""
    from jlong.attention.ulysses import KEEP_ATTENTION_OUTPUT

    def cudnn_attention(q):
        return AttentionKernel("cudnn").local(q, q, q)

    def forward_calls(policy):
        loss = lambda q: jax.checkpoint(cudnn_attention, policy=policy)(q * 2).astype(jnp.float32).sum()  # noqa: E731
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(jnp.ones((1, 256, 4, 64), jnp.bfloat16)))
        return jaxpr.count("dot_product_attention_fwd")

    assert forward_calls(jax.checkpoint_policies.nothing_saveable) == 2  # the check can fail
    assert forward_calls(KEEP_ATTENTION_OUTPUT) == 1
