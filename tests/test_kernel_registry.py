"""Attention kernels are a registry: a kernel registered from outside jlong
is chosen by name or preferred by `auto`, its own settings are described,
and the planner prices its custom calls through its hook."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_step_cost import H100_GPU, MODULE, TWO_NODES

from jlong.attention import kernels
from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.kernels import AttentionKernel, KernelSpec, attend, choose_kernel
from jlong.attention.step import CallCost
from jlong.errors import JlongError
from jlong.planner.hlo import parse_module
from jlong.planner.step_cost import Efficiency, estimate

pytestmark = pytest.mark.fast


def _price_my_attention(target, backend_config, operand_dims):
    if target != "my$attention":
        return None
    (B, S, H, d) = operand_dims[0]
    return CallCost(flops=4 * B * H * S * S * d, backward=False, workspace_bytes=1234)


@pytest.fixture
def registered():
    """A kernel registered as a researcher would: small blocks of the
    blockwise step (its own setting, block_size), preferred by auto on CPU,
    pricing a custom call of its own."""
    saved = dict(kernels._KERNELS)
    spec = KernelSpec("tiny_blocks", lambda a: BlockwiseStep(a.block_size // 4), {"block_size": 512},
                      lambda query: None if query.platform == "cpu" else "CPU only", _price_my_attention)
    kernels.register(spec, preferred=True)
    yield spec
    kernels._KERNELS = saved


def test_a_registered_kernel_is_chosen_by_name_and_preferred_by_auto(registered):
    assert "tiny_blocks" in kernels.impl_names()
    assert choose_kernel("auto", platform="cpu", dtype=jnp.float32, seq_len=64, head_dim=16) == "tiny_blocks"
    assert choose_kernel("auto", platform="gpu", dtype=jnp.bfloat16, seq_len=64, head_dim=64) == "cudnn"
    assert AttentionKernel("tiny_blocks", block_size=64).step(jnp.zeros((1, 64, 2, 8)), window=64) == BlockwiseStep(16)
    assert kernels.describe(AttentionKernel("tiny_blocks", block_size=64)) == "tiny_blocks (block_size 64)"
    q, k, v = jax.random.normal(jax.random.PRNGKey(0), (3, 1, 64, 2, 8))
    np.testing.assert_allclose(attend(q, k, v, impl="tiny_blocks", block_size=64), attend(q, k, v, impl="reference"),
                               rtol=1e-5, atol=1e-6)


def test_an_unknown_kernel_is_one_line():
    with pytest.raises(JlongError, match="attention.impl must be one of auto, cudnn, blockwise, reference, got 'flash'"):
        kernels.check_impl("flash")


def test_the_planner_prices_a_registered_kernels_custom_call_through_its_hook(registered):
    """Without the hook the call would be reported as unpriced; with it, its
    FLOPs count as attention and nothing is left unpriced."""
    call = ('  %mine = bf16[1,1024,4,64]{3,2,1,0} custom-call(%q, %q, %q), custom_call_target="my$attention"\n'
            '  %h-done')
    module = parse_module(MODULE.replace("  %h-done", call, 1))
    cost = estimate(module, gpu=H100_GPU, efficiency=Efficiency(), node_of=TWO_NODES, tokens_per_step=1024,
                    model_flops_per_device=1e9)
    cudnn_causal = 4 * 1 * 4 * 1024 * 1024 * 64 * 1025 / 2048
    assert cost.flops_by_kind["attention"] == cudnn_causal + 4 * 1 * 4 * 1024 * 1024 * 64
    assert cost.unpriced_custom_calls == {}
