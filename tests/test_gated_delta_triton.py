"""The Triton gated delta rule (interpreted on the CPU: the very kernels a
GPU runs) against the rule token by token, in float32: outputs and the
gradients of every input, packed documents, a starting state and its
gradient, a cotangent on the final state, lengths that are not whole chunks,
more value heads than key heads, and the ring's call (float32 values of
width dk + dv from an identity state). Tolerances: 2e-6 absolute on outputs
of order one, 1e-5 relative to the largest gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import H100, needs_gpu_compiler, small_config
from test_qwen3_5 import _rule_inputs

from jlong.errors import JlongError
from jlong.kernel_runs import KernelRuns
from jlong.linear_attention import chunk_terms_triton, chunks, gated_delta, gated_delta_triton
from jlong.ops.pallas_calls import TRITON_CALL
from jlong.planner import pricing
from jlong.planner.cost_report import format_cost
from jlong.planner.hlo import parse_module
from jlong.planner.memory import compile_train_step
from jlong.planner.step_cost import step_cost
from jlong.planner.targets import GPUS

fast = pytest.mark.fast

triton = jax.jit(lambda *a: gated_delta_triton.triton(*a, interpret=True))
# The same in blocks of 64 tokens (one chunk each; sequences longer than `BLOCK` run so): the state passed
# between blocks, each block recomputed in the backward pass.
in_blocks = jax.jit(lambda *a: gated_delta_triton.triton(*a, interpret=True, block=64))
SEGMENTS = np.repeat(np.array([[0, 1, 2]]), [40, 70, 40], axis=1).repeat(2, 0).astype(np.int32)


def _close(got, want, atol=2e-6):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


def _state(B, H, dk, dv, seed=1):
    return np.random.default_rng(seed).normal(size=(B, H, dk, dv)).astype(np.float32)


@pytest.mark.parametrize("rule, with_state", [
    (triton, False), (in_blocks, True),
    # the long tier's: the other two pairings of the rule's blocks and a starting state
    pytest.param(triton, True, marks=pytest.mark.slow), pytest.param(in_blocks, False, marks=pytest.mark.slow),
], ids=["one-block-zero-state", "blocks-state", "one-block-state", "blocks-zero-state"])
def test_outputs_equal_the_rule_token_by_token(rule, with_state):
    """150 tokens: two whole chunks of 64 and a padded third, three documents, Hv = 2 Hk."""
    q, k, v, g, beta = _rule_inputs(dv=16)
    args = (SEGMENTS, _state(2, 4, 16, 16), np.array([5, 0])) if with_state else (SEGMENTS,)
    _close(rule(q, k, v, g, beta, *args), gated_delta.recurrent(q, k, v, g, beta, *args))


@pytest.mark.parametrize("rule", [triton, in_blocks], ids=["one-block", "blocks"])
def test_gradients_of_every_input_equal_the_rule_token_by_token(rule):
    """With a starting state that the first document continues and a
    cotangent on the final state as well as on the outputs."""
    q, k, v, g, beta = _rule_inputs(dv=16)
    weights = np.cos(np.arange(v.size)).reshape(v.shape).astype(np.float32)

    def loss(rule):
        def f(q, k, v, g, beta, state):
            o, final = rule(q, k, v, g, beta, SEGMENTS, state)
            return jnp.sum(o * weights) + 0.3 * jnp.sum(final)
        return jax.grad(f, argnums=range(6))

    args = (q, k, v, g, beta, _state(2, 4, 16, 16))
    got, want = jax.jit(loss(rule))(*args), loss(gated_delta.recurrent)(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * np.abs(b).max())


def test_the_rings_call_in_float32_with_values_of_width_dk_plus_dv():
    assert_the_rings_call_is_the_rules(triton)


def assert_the_rings_call_is_the_rules(rule):
    """`ring_rule`'s summary: an identity state beside zeros, values [0 | v],
    differentiated through the state and with a cotangent on it."""
    q, k, v, g, beta = _rule_inputs(B=1, S=96, dv=16)
    B, _, H, dv = v.shape
    dk = k.shape[-1]
    start = jnp.concatenate([jnp.broadcast_to(jnp.eye(dk), (B, H, dk, dk)), jnp.zeros((B, H, dk, dv))], axis=-1)
    values = jnp.concatenate([jnp.zeros((B, 96, H, dk)), v], axis=-1)
    segments = np.zeros((1, 96), np.int32)

    def summary(rule):
        return lambda values, start: rule(q, k, values, g, beta, segments, start, np.array([0]))[1]

    _close(summary(rule)(values, start), summary(gated_delta.recurrent)(values, start), atol=1e-5)
    cotangent = np.random.default_rng(2).normal(size=start.shape).astype(np.float32)
    pullback = lambda rule: jax.vjp(summary(rule), values, start)[1](cotangent)  # noqa: E731
    got, want = pullback(rule), pullback(gated_delta.recurrent)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-5 * np.abs(b).max())


@fast
def test_bfloat16_inputs_stay_near_the_float32_rule():
    """bf16 matrices into the chunk terms' products and the kernels (the state, the inverse and every
    accumulation float32): outputs and gradients within 2% of the largest."""
    q, k, v, g, beta = _rule_inputs(dv=16)
    bf16 = lambda t: jnp.asarray(t, jnp.bfloat16)  # noqa: E731
    o, final = triton(bf16(q), bf16(k), bf16(v), g, beta, SEGMENTS)
    want_o, want_final = gated_delta.recurrent(q, k, v, g, beta, SEGMENTS)
    assert o.dtype == jnp.bfloat16
    assert np.abs(np.asarray(o, np.float32) - want_o).max() < 0.02 * np.abs(want_o).max()
    assert np.abs(np.asarray(final) - want_final).max() < 0.02 * np.abs(want_final).max()
    # and the gradients of every input (about 0.5% of the largest here)
    do = jnp.asarray(np.random.default_rng(5).standard_normal(np.shape(v)), jnp.float32)

    def loss(rule, *inputs):
        o, final = rule(*inputs, SEGMENTS)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final)

    got = jax.grad(functools.partial(loss, triton), argnums=range(5))(bf16(q), bf16(k), bf16(v), g, beta)
    want = jax.grad(functools.partial(loss, gated_delta.recurrent), argnums=range(5))(q, k, v, g, beta)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
        assert np.abs(np.asarray(a, np.float32) - b).max() < 0.02 * np.abs(b).max(), name


@fast
@pytest.mark.parametrize("chunk, dk, dv, dtype", [(16, 16, 16, jnp.float32), (32, 16, 16, jnp.float32),
                                                  (64, 32, 48, jnp.float32), (64, 32, 48, jnp.bfloat16)],
                         ids=["chunk16", "chunk32", "chunk64", "chunk64-bf16"])
def test_the_chunk_terms_kernel_equals_the_batched_terms(chunk, dk, dv, dtype):
    """Every term and the inverse (I + N)^-1 of chunks of one, two and four diagonal blocks of 16 (inverted
    by doubling and block substitution) against XLA's batched `chunk_terms_and_inverse`: three documents,
    a starting state the first sequence continues, Hv = 2 Hk, 150 tokens padded to whole chunks. Float32
    within 1e-5 of each term's largest; bf16 terms (products in bf16, sums float32) within 1%."""
    tokens = _rule_inputs(dk=dk, dv=dv)
    tokens, seg, prev, _ = chunks.padded_inputs(tokens, jnp.asarray(SEGMENTS), _state(2, 4, dk, dv),
                                                jnp.array([5, 0]), multiple=chunk)
    tokens = [t.astype(dtype) for t in tokens[:3]] + list(tokens[3:])
    with jax.default_matmul_precision("highest"):
        want = chunks.chunk_terms_and_inverse(*tokens, seg, prev, chunk=chunk, operand=dtype)
    got = chunk_terms_triton.forward(*tokens, seg, prev, chunk=chunk, interpret=True)
    tolerance = 1e-5 if dtype == jnp.float32 else 1e-2
    for name, a, b in zip((*chunks.ChunkTerms._fields, "inverse"), (*got[0], got[1]), (*want[0], want[1])):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tolerance * np.abs(b).max(), err_msg=name)


@fast
@pytest.mark.parametrize("chunk, dk, dv, key_heads, dtype", [
    (64, 16, 16, 2, jnp.float32), (64, 32, 48, 2, jnp.float32), (32, 16, 16, 4, jnp.float32),
    (64, 32, 48, 2, jnp.bfloat16)], ids=["one-block", "blocks", "chunk32-a-key-head-each", "blocks-bf16"])
def test_the_chunk_terms_gradient_kernel_equals_autodiff_through_the_terms(chunk, dk, dv, key_heads, dtype):
    """The kernel's gradients of q, k, v, g and beta against jax's autodiff through `chunk_terms` in float32,
    from random recurrence quantities (the states entering the chunks, v_new, and the gradients of o, v_new
    and the states the chunks leave), the terms' cotangents taken from them as the recurrence's backward
    does in XLA: three documents (two starting inside chunks), a starting state the first sequence
    continues (the first chunk reads it) and the second does not, 150 tokens padded to whole chunks; Hv =
    2 Hk and Hv = Hk, key and value widths whole and in blocks of 16 (two and three). Float32 within 1e-5
    of each gradient's largest; bf16 operands (the kernel's products in bf16, sums float32) within 2%."""
    tokens = _rule_inputs(Hk=key_heads, dk=dk, dv=dv)
    tokens, seg, prev, _ = chunks.padded_inputs(tokens, jnp.asarray(SEGMENTS), _state(2, 4, dk, dv),
                                                jnp.array([5, 0]), multiple=chunk)
    rng = np.random.default_rng(dk)
    B, T, H, _ = tokens[2].shape
    by_chunk, by_state = (B, H, T // chunk, chunk, dv), (B, H, T // chunk, dk, dv)
    recurrence = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in (by_chunk,) * 2 + (by_state,)
                  + (by_chunk, by_state)]
    do, d_v_new, states, v_new, d_next = recurrence
    with jax.default_matmul_precision("highest"):
        _, pullback = jax.vjp(lambda *t: chunks.chunk_terms(*t, seg, prev, chunk=chunk), *tokens)
        want = pullback(chunks.ChunkTerms(
            u=d_v_new, w=-jnp.einsum("...cv,...kv->...ck", d_v_new, states),
            a=jnp.einsum("...cv,...jv->...cj", do, v_new), qr=jnp.einsum("...cv,...kv->...ck", do, states),
            kw=jnp.einsum("...cv,...kv->...ck", v_new, d_next), decay=jnp.sum(states * d_next, axis=(-2, -1))))
        inverse = chunks.chunk_terms_and_inverse(*tokens, seg, prev, chunk=chunk)[1]
        in_dtype = [t.astype(dtype) for t in tokens[:3]] + list(tokens[3:])
        got = chunk_terms_triton.backward(*in_dtype, seg, prev, inverse, *(t.astype(dtype) for t in recurrence),
                                          chunk=chunk, interpret=True)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("q", "k", "v", "g", "beta"), got, want):
        assert a.shape == b.shape, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=0, atol=tolerance * np.abs(b).max(), err_msg=name)


@fast
def test_the_outputs_kernel_takes_64_value_columns_a_program_where_the_width_allows():
    """Qwen3.5's 128 and the ring's 256 in blocks of 64; the tiny models' narrower widths whole."""
    widths = (16, 32, 48, 64, 128, 256)
    assert [gated_delta_triton._outputs_block_v(dv) for dv in widths] == [16, 32, 16, 64, 64, 64]
    with pytest.raises(JlongError, match="multiples of 16, got 40"):
        gated_delta_triton._outputs_block_v(40)


@fast
@pytest.mark.parametrize("chunk", [8, 48])
def test_the_chunk_terms_take_chunks_of_a_power_of_two_of_16_or_more_only(chunk):
    q, k, v, g, beta = _rule_inputs(B=1, S=96)
    segments = jnp.zeros((1, 96), jnp.int32)
    with pytest.raises(JlongError, match=f"chunks of a power of two tokens, 16 or more, got {chunk}") as raised:
        chunk_terms_triton.forward(q, k, v, g, beta, segments, segments, chunk=chunk, interpret=True)
    assert "\n" not in str(raised.value)


@fast
def test_the_registry_runs_it_interpreted_where_asked_and_auto_picks_it_on_gpus_once_its_kernels_ran_on_one():
    every_kernel_ran = KernelRuns(frozenset(gated_delta.GPU_KERNEL_NAMES["triton"]))
    assert gated_delta.kernel_for("gpu", every_kernel_ran) == "triton"
    assert gated_delta.kernel_for("cpu", every_kernel_ran) == "chunked"
    q, k, v, g, beta = _rule_inputs(B=1, S=64, dv=16)
    _close(gated_delta.rule("triton", interpret=True)(q, k, v, g, beta), gated_delta.recurrent(q, k, v, g, beta))
    assert gated_delta.rule("chunked", interpret=True) is gated_delta.chunked


@fast
def test_the_kernels_calls_are_priced_at_their_recurrences_flops():
    """Per chunk, head and value column: the forward's two products 4 C dk, the backward's four 2 C (3 dk + C);
    the outputs' per chunk and value column; the chunk terms' and their gradient's per value head and
    chunk."""
    BH, n, C, dv, dk = 48, 2048, 64, 128, 128
    dims = [[BH, n, C, dv], [BH, n, C, dk], [BH, n, C, C]]
    for name, per_column in ((gated_delta_triton.FORWARD, 4 * C * dk),
                             (gated_delta_triton.BACKWARD, 2 * C * (3 * dk + C))):
        attributes = f'name = "{name}", num_stages = 1'
        flops = gated_delta_triton.call_flops(TRITON_CALL, attributes, dims, (BH, n, C, dv))
        assert flops == BH * n * dv * per_column
        assert pricing.kernel_flops(TRITON_CALL, attributes, dims, (BH, n, C, dv)) == \
            (flops, "gated delta")
        assert gated_delta_triton.call_flops("other", attributes, dims, ()) is None
    # The outputs' kernel, o = qr S + a v_new: 2 C (dk + C) per chunk and value column, a kind of its own (never
    # run on a GPU: priced at a measured sibling's rate).
    attributes = f'name = "{gated_delta_triton.OUTPUTS}", num_stages = 3'
    dims = [[BH, n, C, dk], [BH, n, C, C], [BH, n, dk, dv], [BH, n, C, dv]]
    assert pricing.kernel_flops(TRITON_CALL, attributes, dims, (BH, n, C, dv)) == (
        BH * n * dv * 2 * C * (dk + C), "gated delta outputs")
    assert gated_delta_triton.call_flops(TRITON_CALL, attributes, dims, ()) is None
    # The chunk terms, per value head and chunk of 64: ten blocks of 16 x 16 on and below the diagonal, each
    # with four products (N's and a's of width dk, w's of dk, u's of dv), and the inverse's: four blocks'
    # four doublings of two products and the substitution's ten products of sums and six of the diagonal
    # blocks' inverses, 48 products of 16 x 16 blocks. A kind of their own, as the gradient's.
    B, T, H, Hk = 2, n * C, 24, 12
    attributes = f'name = "{chunk_terms_triton.FORWARD_NAME}", num_stages = 1'
    dims = [[B, T, Hk, dk], [B, T, Hk, dk], [B, T, H, dv], [B, T, H], [B, T, H], [B, T], [B, T]]
    assert pricing.kernel_flops(TRITON_CALL, attributes, dims, (B, H, n, C, dv)) == (
        B * H * n * (10 * 2 * 16**2 * (3 * dk + dv) + 48 * 2 * 16**3), "gated delta chunk terms")
    # The chunk terms' gradient: per value head and chunk, C^2 (16 dk + 6 dv) in its products of width dk
    # and dv, 8 C dk dv in the terms' gradients from the states' and 4 C^3 in the inverse's gradient. Its
    # operands: q, k [B, T, Hk, dk], v [B, T, H, dv], g, beta [B, T, H],
    # seg, prev [B, T], the inverses [B, H, n, C, C], then the recurrence's.
    attributes = f'name = "{chunk_terms_triton.BACKWARD_NAME}", num_stages = 1'
    dims = [[B, T, Hk, dk], [B, T, Hk, dk], [B, T, H, dv], [B, T, H], [B, T, H], [B, T], [B, T], [B, H, n, C, C]]
    assert pricing.kernel_flops(TRITON_CALL, attributes, dims, ()) == (
        B * H * n * (C**2 * (16 * dk + 6 * dv + 4 * C) + 8 * C * dk * dv), "gated delta chunk terms")
    assert chunk_terms_triton.call_flops(TRITON_CALL, f'name = "{gated_delta_triton.OUTPUTS}", num_stages = 3',
                                         dims, ()) is None


@needs_gpu_compiler
def test_a_qwen3_5_step_compiles_for_h100s_with_the_triton_rule_priced():
    """XLA:GPU, deviceless: the Triton rule (by name) on Ulysses x ring (its own chunks and the ring's float32
    calls); its kernels' calls are priced at their FLOPs, none unpriced, and the plan names the kernels the
    committed race record says never ran on a GPU (the outputs' and the chunk terms')."""
    config = small_config("model.preset=tiny-qwen3.5", "model.num_hidden_layers=4", "train.seq_len=2048",
                          "train.batch_size=1", "mesh.ring=2", "mesh.sp=4", "kernels.gated_delta=triton")
    step = compile_train_step(config, H100)
    hlo = step.text
    unraced = (gated_delta_triton.OUTPUTS, chunk_terms_triton.FORWARD_NAME, chunk_terms_triton.BACKWARD_NAME)
    for name in (gated_delta_triton.FORWARD, gated_delta_triton.BACKWARD, *unraced):
        assert hlo.count(f'"{name}"') > 0, name
    cost = step_cost(step)
    assert not cost.unpriced_custom_calls and cost.time_by_kind["gated delta"] > 0
    assert sorted(cost.unmeasured_kernels) == sorted(unraced)
    report = format_cost(cost)
    assert "never run on a GPU" in report and all(name in report for name in unraced)


@needs_gpu_compiler
@pytest.mark.parametrize("dtype, width, backward", [
    (jnp.bfloat16, 128, True), (jnp.float32, 256, True),
    pytest.param(jnp.float32, 192, False, marks=pytest.mark.slow)],  # the long tier's: a width no power of two
    ids=["bf16", "ring-float32", "ring-float32-values-of-64-forward"])
def test_its_kernels_fit_an_h100s_shared_memory_at_qwen3_5s_head_sizes(dtype, width, backward):
    """XLA:GPU, deviceless (Triton checks each kernel's shared memory against the SM's, and lowers only loads
    of power-of-two shapes): the recurrence's forward and backward, the chunk terms, their gradient and
    the outputs at dk = 128, with values of 128 in bf16 (training) and of dk + dv = 256 in float32 (the
    ring's summaries); the forward kernels at 192 (a ring's summaries for values of 64, a width no power of
    two, where a forward once loaded whole rows). The tiny models of the other tests use heads far too small
    to find out."""
    sharding = jax.sharding.SingleDeviceSharding(H100.devices(1)[0])
    B, T, H, dk = 1, 256, 2, 128
    spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    args = (spec(B, T, H, dk), spec(B, T, H, dk), spec(B, T, H, width), spec(B, T, H, dt=jnp.float32),
            spec(B, T, H, dt=jnp.float32))

    def loss(q, k, v, g, beta):
        o, final = gated_delta_triton.triton(q, k, v, g, beta)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final)

    step = jax.value_and_grad(loss, argnums=range(5)) if backward else loss
    hlo = jax.jit(step).lower(*args).compile().as_text()  # the loss reads o
    names = [gated_delta_triton.FORWARD, gated_delta_triton.OUTPUTS, chunk_terms_triton.FORWARD_NAME]
    if backward:
        names += [gated_delta_triton.BACKWARD, chunk_terms_triton.BACKWARD_NAME]
    for name in names:
        assert f'"{name}"' in hlo, name


def _priced(kernel: str, operands: list[str], result: str) -> tuple[float, float]:
    """(the planner's seconds, its products' cost over bf16 ones) for a Triton call named `kernel` on parameters of
    the HLO types `operands` with a result of the type `result`, alone in a program."""
    text = "\n".join([
        "HloModule priced", "",
        "ENTRY %main ({}) -> {} {{".format(", ".join(f"p{i}: {t}" for i, t in enumerate(operands)), result),
        *(f"  %p{i} = {t} parameter({i})" for i, t in enumerate(operands)),
        "  ROOT %call = {} custom-call({}), custom_call_target=\"{}\", backend_config={{grid_x = 1 : i32, "
        "name = \"{}\", num_stages = 3}}".format(result, ", ".join(f"%p{i}" for i in range(len(operands))),
                                                 TRITON_CALL, kernel),
        "}"])
    module = parse_module(text)
    entry = module.entry_computation
    kind, seconds = pricing.Pricer(module, GPUS["h100"], pricing.Efficiency(), [0]).price(entry.root, entry,
                                                                                         pricing.Tally())
    assert kind == "compute"
    return seconds, pricing._product_cost(entry.root, entry, pricing._kernel_flops(entry.root, entry)[0])


def test_the_planner_prices_float32_products_as_the_kernels_run_them():
    """The kernels take float32 products (the ring's summaries) as three TF32 ones (jlong.ops.triton_dots),
    each at half the bf16 rate: a compute-bound recurrence call with float32 terms is priced at six times
    the bf16 one's time (same FLOPs; its memory traffic bounds neither). The chunk terms' kernels take some
    products in float32 in every dtype, priced so: the forward's inverse at IEEE precision (scalar FMAs at an
    H100's 66.9 float32 TFLOP/s), the backward's inverse gradient, 4 C^3 a chunk, as three TF32 products; a
    bf16 call stays bf16 where its float32 inverses are its largest operand (narrow heads)."""
    BH, n, C = 32, 512, 64
    T = n * C

    def recurrence(dtype):  # u, w, kw, the decays and the starting state -> the final state (dk = dv = 128)
        return _priced(gated_delta_triton.FORWARD, [f"{dtype}[{BH},{n},{C},128]"] * 3 + [
            f"f32[{BH},{n}]", f"f32[{BH},128,128]"], f"f32[{BH},128,128]")

    def terms(dtype, dk, dv):  # q, k, v, g, beta, seg, prev -> u first
        return _priced(chunk_terms_triton.FORWARD_NAME, [f"{dtype}[1,{T},{BH},{dk}]"] * 2 + [
            f"{dtype}[1,{T},{BH},{dv}]"] + [f"f32[1,{T},{BH}]"] * 2 + [f"s32[1,{T}]"] * 2,
            f"{dtype}[1,{BH},{n},{C},{dv}]")

    def terms_gradient(dtype, dk, dv):  # q, k, v, g, beta, seg, prev, the inverses, do, dv_new, states, v_new, d_next
        by_chunk, by_state = f"{dtype}[1,{BH},{n},{C},{dv}]", f"{dtype}[1,{BH},{n},{dk},{dv}]"
        return _priced(chunk_terms_triton.BACKWARD_NAME, [f"{dtype}[1,{T},{BH},{dk}]"] * 2 + [
            f"{dtype}[1,{T},{BH},{dv}]"] + [f"f32[1,{T},{BH}]"] * 2 + [f"s32[1,{T}]"] * 2 + [
            f"f32[1,{BH},{n},{C},{C}]", by_chunk, by_chunk, by_state, by_chunk, by_state], f"{dtype}[1,{T},{BH},{dk}]")

    assert recurrence("f32")[0] == pytest.approx(6 * recurrence("bf16")[0], rel=1e-9)
    assert recurrence("bf16")[1] == 1.0 and recurrence("f32")[1] == 6
    ieee = 48 * 2 * 16**3  # the forward's inverse, per chunk (test_the_kernels_calls_are_priced_at_...)
    tf32 = 4 * C**3  # the backward's inverse gradient, per chunk
    for dk, dv in ((128, 256), (32, 32)):
        forward = 10 * 2 * 16**2 * (3 * dk + dv) + ieee
        assert terms("bf16", dk, dv)[1] == pytest.approx((forward - ieee + ieee * 989.4 / 66.9) / forward)
        assert terms("f32", dk, dv)[1] == pytest.approx(((forward - ieee) * 6 + ieee * 989.4 / 66.9) / forward)
        backward = C**2 * (16 * dk + 6 * dv + 4 * C) + 8 * C * dk * dv
        assert terms_gradient("bf16", dk, dv)[1] == pytest.approx((backward - tf32 + tf32 * 6) / backward)
        assert terms_gradient("f32", dk, dv)[1] == pytest.approx(6)
    # the split itself, and None for another kernel's call
    dims = [[1, T, BH, 128], [1, T, BH, 128], [1, T, BH, 256], [1, T, BH], [1, T, BH], [1, T], [1, T], [1, BH, n, C, C]]
    name = lambda kernel: f'name = "{kernel}", num_stages = 1'  # noqa: E731
    assert chunk_terms_triton.float32_flops(TRITON_CALL, name(chunk_terms_triton.FORWARD_NAME), dims,
                                            (1, BH, n, C, 256)) == (BH * n * ieee, 0.0)
    assert chunk_terms_triton.float32_flops(TRITON_CALL, name(chunk_terms_triton.BACKWARD_NAME), dims, ()) == (
        0.0, BH * n * tf32)
    assert chunk_terms_triton.float32_flops(TRITON_CALL, name(gated_delta_triton.OUTPUTS), dims, ()) is None
