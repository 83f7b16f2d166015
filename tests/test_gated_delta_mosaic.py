"""The Mosaic GPU gated delta rule (its two recurrence kernels interpreted on the CPU, one device: jax
0.10's interpreter runs no kernel inside shard_map over several) against the rule token by token in
float32: bf16 outputs and gradients of every input within 2% of the largest, with packed documents, a
starting state and its gradient, a cotangent on the final state, a length that is not whole chunks and
more value heads than key heads; the ring's float32 call (values of width dk + dv from an identity
state) within 1e-5. Deviceless for H100s: both kernels compile at Qwen3.5's head sizes, and a Qwen3.5
step on Ulysses x ring compiles on them with every call priced."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import H100, assert_same_result, interpreted, loss_and_grads, needs_gpu_compiler, small_config
from test_gated_delta_triton import SEGMENTS, _state, assert_the_rings_call_is_the_rules
from test_qwen3_5 import _rule_inputs, _tiny

from jlong.errors import JlongError
from jlong.kernel_runs import KernelRuns
from jlong.linear_attention import gated_delta, gated_delta_mosaic
from jlong.planner import pricing
from jlong.planner.memory import compile_train_step
from jlong.parallel.placement import make_mesh
from jlong.planner.step_cost import step_cost
from jlong.program.train_program import TrainProgram

mosaic = jax.jit(lambda *a: gated_delta_mosaic.mosaic(*a, interpret=True))

def _bf16(t):
    return jnp.asarray(t, jnp.bfloat16)


@pytest.mark.parametrize("width", [64, 128])
def test_bfloat16_outputs_and_gradients_stay_near_the_float32_rule(width):
    """Widths of 64 (one key tile, one program of value columns) and 128 (two of each: Qwen3.5's heads)."""
    q, k, v, g, beta = _rule_inputs(dk=width, dv=width)
    state = _state(2, 4, width, width)
    assert "gated_delta_mosaic_forward" in str(jax.make_jaxpr(mosaic)(_bf16(q), _bf16(k), _bf16(v), g, beta))
    do = np.random.default_rng(5).standard_normal(np.shape(v)).astype(np.float32)

    def loss(rule, q, k, v, g, beta, state):
        o, final = rule(q, k, v, g, beta, SEGMENTS, state)
        return jnp.sum(o.astype(jnp.float32) * do) + 0.3 * jnp.sum(final), (o, final)

    (_, (o, final)), got = interpreted(jax.value_and_grad(functools.partial(loss, mosaic), argnums=range(6),
                                                          has_aux=True))(_bf16(q), _bf16(k), _bf16(v), g, beta, state)
    (_, (want_o, want_final)), want = jax.value_and_grad(
        functools.partial(loss, gated_delta.recurrent), argnums=range(6), has_aux=True)(q, k, v, g, beta, state)
    assert o.dtype == jnp.bfloat16
    for name, a, b in zip(("o", "final", "q", "k", "v", "g", "beta", "state"), (o, final, *got),
                          (want_o, want_final, *want)):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.abs(a - b).max() < 0.02 * np.abs(b).max(), (name, np.abs(a - b).max() / np.abs(b).max())


def test_the_rings_call_in_float32_with_values_of_width_dk_plus_dv():
    """Float32 terms run the two passes as scans in XLA: the ring's summary, through its state too."""
    assert_the_rings_call_is_the_rules(mosaic)


@pytest.mark.fast
def test_a_model_on_the_cpu_refuses_it_in_one_line():
    """jax's Mosaic GPU interpreter calls back to the host, which a model's checkpoints refuse: a model runs
    the rule on GPUs only (its step compiles for H100s below; the rule itself is tested above)."""
    config = _tiny("train.compute_dtype=bfloat16", "model.linear_key_head_dim=64", "model.linear_value_head_dim=64",
                   "kernels.gated_delta=mosaic")
    with pytest.raises(JlongError, match="kernels.gated_delta=mosaic runs in a bf16 model on GPUs only") as raised:
        TrainProgram(config, make_mesh(config.mesh, jax.devices()[:1]))
    assert "\n" not in str(raised.value) and "chunked" in str(raised.value)


def test_a_float32_model_on_the_cpu_runs_its_scans_as_the_chunked_rule_does():
    """In float32 no kernel runs (the two passes are scans in XLA), so a CPU model may choose it."""
    one = jax.devices()[:1]
    got = loss_and_grads(_tiny("train.seq_len=128", "kernels.gated_delta=mosaic"), one)
    assert_same_result(got, loss_and_grads(_tiny("train.seq_len=128", "kernels.gated_delta=chunked"), one))


@pytest.mark.fast
def test_widths_the_kernels_cannot_take_are_one_line():
    q, k, v, g, beta = _rule_inputs(B=1, S=64, dk=16, dv=16)
    with pytest.raises(JlongError, match="multiples of 64, got chunks of 64, widths 16 and 16: set kernels"):
        mosaic(_bf16(q), _bf16(k), _bf16(v), g, beta)


@pytest.mark.fast
def test_it_is_registered_and_auto_picks_it_on_gpus_once_it_alone_has_run_on_one():
    assert gated_delta.KERNELS["mosaic"] is gated_delta_mosaic.mosaic
    assert gated_delta.rule("mosaic", interpret=True).keywords == {"interpret": True}
    mosaic_ran = KernelRuns(frozenset(gated_delta.GPU_KERNEL_NAMES["mosaic"]))
    assert gated_delta.kernel_for("gpu", mosaic_ran) == "mosaic"
    assert gated_delta.kernel_for("cpu", mosaic_ran) == "chunked"


@pytest.mark.fast
def test_the_kernels_calls_are_priced_at_their_recurrences_flops():
    """Per chunk, head and value column: the forward's two products 4 C dk, the backward's four 2 C (3 dk + C),
    known by the kernels' names in the call's op_name."""
    BH, n, C, dv, dk = 48, 2048, 64, 128, 128
    dims = [[BH * n * C, dv], [BH * n * C, dk]]
    call = gated_delta_mosaic.MOSAIC_CALL
    for name, per_column in ((gated_delta_mosaic.FORWARD, 4 * C * dk),
                             (gated_delta_mosaic.BACKWARD, 2 * C * (3 * dk + C))):
        attributes = f'metadata={{op_name="jit(step)/{name}/mosaic_gpu_call"}}'
        flops = gated_delta_mosaic.call_flops(call, attributes, dims, ())
        assert flops == BH * n * dv * per_column
        assert pricing.kernel_flops(call, attributes, dims, ()) == (flops, "gated delta (mosaic)")
        assert gated_delta_mosaic.call_flops("other", attributes, dims, ()) is None


@needs_gpu_compiler
def test_both_kernels_fit_an_h100s_shared_memory_at_qwen3_5s_head_sizes():
    """dk = dv = 128 in bf16, forward and backward, compiled for one H100 (Mosaic GPU lowers each kernel
    against the SM's shared memory)."""
    sharding = jax.sharding.SingleDeviceSharding(H100.devices(1)[0])
    B, T, H, dk = 1, 256, 2, 128
    spec = lambda *shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    args = (spec(B, T, H, dk), spec(B, T, H, dk), spec(B, T, H, dk), spec(B, T, H, dt=jnp.float32),
            spec(B, T, H, dt=jnp.float32))

    def loss(q, k, v, g, beta):
        o, final = gated_delta_mosaic.mosaic(q, k, v, g, beta)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    hlo = jax.jit(jax.grad(loss, argnums=range(5))).lower(*args).compile().as_text()
    assert f"/{gated_delta_mosaic.FORWARD}/" in hlo and f"/{gated_delta_mosaic.BACKWARD}/" in hlo


@pytest.mark.slow  # CI compiles the kernels above and the Triton rule's step (sm90's default) in a step
@needs_gpu_compiler
def test_a_qwen3_5_step_compiles_for_h100s_with_the_mosaic_rule_priced():
    """On Ulysses x ring (the kernels on the rule's bf16 chunks, the scans on the ring's float32 calls), with
    Qwen3.5's linear head sizes: every kernel call priced at its FLOPs, as "gated delta (mosaic)"."""
    config = small_config("model.preset=tiny-qwen3.5", "model.num_hidden_layers=4", "train.seq_len=2048",
                          "train.batch_size=1", "mesh.ring=2", "mesh.sp=4", "train.compute_dtype=bfloat16",
                          "model.linear_key_head_dim=128", "model.linear_value_head_dim=128",
                          "kernels.gated_delta=mosaic")
    step = compile_train_step(config, H100)
    hlo = step.text
    assert f"/{gated_delta_mosaic.FORWARD}/" in hlo and f"/{gated_delta_mosaic.BACKWARD}/" in hlo
    cost = step_cost(step)
    assert not cost.unpriced_custom_calls and cost.time_by_kind["gated delta (mosaic)"] > 0
