"""Ulysses/UPipe attention equals the plain single-device attention block."""

import itertools

import jax
import jax.numpy as jnp
import pytest
from attention_cases import (
    assert_block_close,
    attention_inputs,
    attention_model,
    attention_params,
    reference_block,
    sharded_block,
    value_and_grads,
)

from jlong.attention.kernels import AttentionKernel
from jlong.attention.methods.ulysses import StagePlan
from jlong.config import MeshConfig
from jlong.families import blocks
from jlong.model.transformer import ForwardOptions


@pytest.mark.parametrize(
    "H, K, C, U",
    [(H, K, C, U) for H, K in [(32, 1), (32, 2), (32, 8), (32, 32), (40, 8), (48, 4), (28, 4)]
     for C in (1, 2, 4, 8) for U in range(C, H + 1, C) if H % C == 0 and H % U == 0],
)
@pytest.mark.fast
def test_stage_plan_gives_every_query_head_its_kv_head(H, K, C, U):
    plan = StagePlan(H, K, C, U)
    width, first, slots = plan.kv_window
    r, g, u = plan.kv_per_device, plan.local_group, plan.heads_per_device
    assert width <= K and first.min() >= 0 and (first + width).max() <= K
    for stage, c, j in itertools.product(range(plan.num_stages), range(C), range(u)):
        query_head = stage * U + c * u + j
        slot = c * r + j // g  # the attention kernel groups local heads in runs of g
        assert first[stage] + slots[stage, slot] == query_head // (H // K)


@pytest.mark.parametrize("sp, kv_heads, packed", [
    (2, 2, False), (2, 2, True), (4, 8, True), (8, 1, True),
    # the long tier's: packed rows already mask causally within each document
    pytest.param(4, 8, False, marks=pytest.mark.slow), pytest.param(8, 1, False, marks=pytest.mark.slow),
], ids=["2-2-causal", "2-2-packed", "4-8-packed", "8-1-packed", "4-8-causal", "8-1-causal"])
def test_ulysses_stages_equal_single_device(sp, kv_heads, packed):
    """32 query heads; U in {C, 2C, H}; the rest of the 8 devices is fsdp.
    Each sp degree meets one kv layout (every device's heads on one kv head,
    two, or a kv head per two query heads); the stage plan's bookkeeping is
    checked for every combination above."""
    model = attention_model(32, kv_heads)
    params = attention_params(model)
    inputs = attention_inputs(model, packed=packed)
    want = reference_block(model, params, inputs)
    for U in (sp, 2 * sp, 32):
        got = sharded_block(model, params, inputs, MeshConfig(fsdp=8 // sp, sp=sp), U)
        assert_block_close(got, want)


@pytest.mark.parametrize("U", [8, 40])
def test_qwen25_14b_head_layout_on_sp8(U):
    """40 query heads over 8 kv heads: 5 query heads per kv head, on sp=8."""
    model = attention_model(40, 8, qkv_extras=True)
    params = attention_params(model)
    inputs = attention_inputs(model, batch=1, packed=True)
    want = reference_block(model, params, inputs)
    assert_block_close(sharded_block(model, params, inputs, MeshConfig(sp=8), U), want)


def test_single_device_stages_equal_plain_attention():
    """sp = 1 runs the same stages without collectives (no mesh at all)."""
    model = attention_model(8, 2, qkv_extras=True)
    params = attention_params(model)
    x, cotangent, positions, segment_ids = inputs = attention_inputs(model, batch=2, packed=True)
    want = reference_block(model, params, inputs)
    for stages in (8, 4, 2):  # U = 1, 2, 4
        options = ForwardOptions(attention=AttentionKernel("blockwise", 16), head_stages=stages)
        block = lambda p, x, pos, seg: blocks.attention(p, x, pos, seg, model, options)  # noqa: E731
        got = jax.jit(value_and_grads, static_argnums=0)(block, params, x, positions, segment_ids, cotangent)
        assert_block_close(got, want)


@pytest.mark.fast
def test_stage_remat_keeps_the_cudnn_forward():
    """Traced on CPU: under the stage policy the backward pass reuses the
    fused forward's output instead of running cuDNN's forward kernel a
    second time."""
    from jlong.attention.methods.base import KEEP_ATTENTION_OUTPUT

    def cudnn_attention(q):
        return AttentionKernel("cudnn").local(q, q, q)

    def forward_calls(policy):
        loss = lambda q: jax.checkpoint(cudnn_attention, policy=policy)(q * 2).astype(jnp.float32).sum()  # noqa: E731
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(jnp.ones((1, 256, 4, 64), jnp.bfloat16)))
        return jaxpr.count("dot_product_attention_fwd")

    assert forward_calls(jax.checkpoint_policies.nothing_saveable) == 2  # the check can fail
    assert forward_calls(KEEP_ATTENTION_OUTPUT) == 1
