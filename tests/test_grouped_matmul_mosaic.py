"""The Mosaic GPU grouped matmul: interpreted on the CPU against ragged_dot
(outputs and both gradients), compiled deviceless for H100s (lowering and
shared memory, not speed) and priced by the planner from its own calls."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import H100, REPO, interpreted, needs_gpu_compiler

from jlong.config import load_config
from jlong.errors import JlongError
from jlong.moe import grouped_matmul, grouped_matmul_mosaic
from jlong.planner.memory import compile_train_step
from jlong.planner.pricing import Efficiency
from jlong.planner.step_cost import step_cost

# Empty groups, a group of one row, groups spanning two product tiles (128 rows) and two weight-gradient
# tiles (64), several groups in one tile, and 300 rows: not a whole number of tiles.
GROUP_SIZES = [30, 0, 140, 1, 0, 64, 65, 0]


def _linear_loss(kernel, cotangent, sizes):
    """sum(out * cotangent): the output's gradient is the cotangent itself, whatever the output's rounding."""
    return lambda x, w: jnp.sum(kernel(x, w, sizes).astype(jnp.float32) * cotangent)


@pytest.mark.fast
def test_the_interpreted_kernels_equal_ragged_dot_with_their_gradients():
    """bf16 operands (what the kernels take), float32 references on the same values: each result differs
    from the reference by its rounding to bf16 (relative 2^-9; 2^-8 allowed) beside float32 sums' order."""
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)
    x = jnp.asarray(rng.standard_normal((sum(GROUP_SIZES), 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((len(GROUP_SIZES), 128, 64)), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((x.shape[0], 64)), jnp.bfloat16).astype(jnp.float32)
    mosaic = functools.partial(grouped_matmul_mosaic.grouped_matmul, interpret=True)

    out, grads = interpreted(jax.value_and_grad(_linear_loss(mosaic, cotangent, sizes), argnums=(0, 1)))(x, w)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    want, want_grads = jax.value_and_grad(_linear_loss(jax.lax.ragged_dot, cotangent, sizes), argnums=(0, 1))(
        f32(x), f32(w))
    products = interpreted(mosaic)(x, w, sizes)
    reference = jax.lax.ragged_dot(f32(x), f32(w), sizes)
    for got, ref in [(products, reference), *zip(grads, want_grads)]:
        assert got.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(f32(got)), np.asarray(ref), rtol=2**-8,
                                   atol=1e-5 * float(jnp.abs(ref).max()))
    assert np.abs(np.asarray(f32(grads[1]))[[1, 4, 7]]).max() == 0  # empty groups' weights: no gradient
    np.testing.assert_allclose(float(out), float(want), rtol=1e-2)


@pytest.mark.fast
def test_a_float32_operand_or_a_width_not_a_multiple_of_64_is_one_line():
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(JlongError, match="bf16 or f16 operands"):
        grouped_matmul_mosaic.grouped_matmul(jnp.ones((8, 64)), jnp.ones((2, 64, 64)), sizes, interpret=True)
    with pytest.raises(JlongError, match="matrix widths that are multiples of 64, got 32"):
        grouped_matmul_mosaic.grouped_matmul(jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 64, 32), jnp.bfloat16),
                                             sizes, interpret=True)


@pytest.mark.fast
def test_the_mosaic_kernel_is_a_registered_gpu_kernel():
    assert grouped_matmul.KERNELS["mosaic"] is grouped_matmul_mosaic.grouped_matmul
    assert grouped_matmul.matmul("mosaic", interpret=True).keywords == {"interpret": True}


@needs_gpu_compiler
def test_a_qwen3_moe_step_compiles_for_h100_on_the_mosaic_kernels_and_is_priced_by_their_flops():
    """Two layers of configs/qwen3-30b-a3b-1m.yaml at 32,768 tokens on 8 H100s (sp 8), experts on the
    Mosaic GPU kernels: each of the three kernels compiles at the real expert shapes within an SM's
    shared memory, the planner counts the routed rows' FLOPs and prices them at the Mosaic efficiency."""
    config = load_config(REPO / "configs" / "qwen3-30b-a3b-1m.yaml", [
        "train.seq_len=32768", "model.num_hidden_layers=2", "memory.remat=offload_inputs", "memory.remat_runs={}",
        "kernels.grouped_matmul=mosaic"])
    step = compile_train_step(config, H100)
    text = step.text
    for name in (grouped_matmul_mosaic.PRODUCT, grouped_matmul_mosaic.WEIGHT_GRADIENT):
        assert f"/{name}/" in text
    cost = step_cost(step)
    assert not cost.unpriced_custom_calls and not cost.unknown_trip_loops
    assert cost.model_flops <= cost.executed_flops <= 1.6 * cost.model_flops
    mosaic = cost.time_by_kind["grouped matmul (mosaic)"]
    assert mosaic > 0 and "grouped matmul" not in cost.time_by_kind
    twice = step_cost(step, Efficiency(grouped_matmul_mosaic=2 * Efficiency().grouped_matmul_mosaic))
    assert twice.time_by_kind["grouped matmul (mosaic)"] == pytest.approx(mosaic / 2, rel=0.02)


WITHOUT_PALLAS_TRITON = """
import sys
sys.modules["jax.experimental.pallas.triton"] = None  # as a jax that has removed the backend
import jax, jax.numpy as jnp
from jlong.kernel_runs import KernelRuns
from jlong.linear_attention import gated_delta
from jlong.moe import grouped_matmul
from jlong.planner import pricing
assert "triton" not in grouped_matmul.KERNELS and "triton" not in gated_delta.KERNELS
# XLA's on GPUs until the Mosaic GPU kernels have run on one, then those
assert grouped_matmul.kernel_for("gpu") == "ragged_dot" and gated_delta.kernel_for("gpu") == "chunked"
ran = KernelRuns(frozenset(grouped_matmul.GPU_KERNEL_NAMES["mosaic"] + gated_delta.GPU_KERNEL_NAMES["mosaic"]))
assert grouped_matmul.kernel_for("gpu", ran) == "mosaic" and gated_delta.kernel_for("gpu", ran) == "mosaic"
assert [kind for _, kind in pricing.KERNEL_PRICES] == ["grouped matmul (mosaic)", "gated delta (mosaic)"]
x, w = jnp.ones((64, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16)
out = grouped_matmul.matmul("mosaic", interpret=True)(x, w, jnp.asarray([40, 24], jnp.int32))
assert float(out[0, 0]) == 64.0
print("ok")
"""


def test_without_pallas_triton_jlong_imports_and_gpus_run_the_mosaic_grouped_matmul():
    """Once jax removes Pallas' Triton backend (deprecated since 0.11), jlong still imports, lists no Triton
    kernel, and runs the Mosaic GPU kernels on GPUs (`auto`) once they have run on one (XLA's until then)."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_PALLAS_TRITON], capture_output=True, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
