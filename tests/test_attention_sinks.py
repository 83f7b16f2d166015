"""Attention sinks (GPT-OSS: one logit per query head in every softmax's
denominator) and Wo's bias, exact on every attention path: the reference
against a hand-written softmax, the flash kernels against the reference,
each sequence-parallel method on the 8-device mesh against one device, and
the refusal of a kernel that has not said it runs sinks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import assert_block_close, attention_inputs, attention_model, attention_params, value_and_grads
from cudnn_emulation import emulate_cudnn

from jlong.attention import kernels
from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.kernels import AttentionKernel, KernelSpec, reference_attention
from jlong.attention.methods.allgather import ALLGATHER
from jlong.attention.methods.base import SequenceParallelMethod
from jlong.attention.methods.ulysses import ULYSSES
from jlong.config import MeshConfig
from jlong.errors import JlongError
from jlong.families import blocks
from jlong.model.transformer import ForwardOptions
from jlong.ops.layers import apply_rope, rms_norm, rope_inverse_frequencies
from jlong.ops.shards import HIDDEN, TOKENS
from jlong.ops.zigzag import SequenceLayout
from jlong.parallel.placement import MeshShards, compute_sharding, make_mesh

B, S, H, K, d = 2, 32, 8, 2, 16
SINKS = jnp.asarray([3.0, -3.0, 1.5, -1.5, 0.5, 2.5, -2.0, 0.0])  # far from zero both ways


def _qkv(seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (B, S, H, d))
    k, v = (jax.random.normal(key, (B, S, K, d)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape)


def _packed(seed=0):
    starts = np.random.default_rng(seed).random((B, S)) < 0.12
    starts[0, 1:] = [False] * (S - 1)  # row 0 one document, row 1 several
    return jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


MASKS = {"causal": (None, 0), "packed": (_packed(), 0), "window": (None, 5), "packed window": (_packed(), 5)}


def _by_hand(q, k, v, segments, window, sinks):
    """Each query's softmax over the keys it sees plus exp(sink) in the denominator, in numpy float64."""
    q, k, v, sinks = (np.asarray(x, np.float64) for x in (q, k, v, sinks))
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)
    out = np.zeros(q.shape)
    for b in range(B):
        mask = seen if segments is None else seen & (np.asarray(segments)[b][:, None] == np.asarray(segments)[b])
        for h in range(H):
            kv = h // (H // K)
            e = np.where(mask, np.exp(q[b, :, h] @ k[b, :, kv].T / np.sqrt(d)), 0.0)
            out[b, :, h] = e @ v[b, :, kv] / (e.sum(1, keepdims=True) + np.exp(sinks[h]))
    return out


@pytest.mark.parametrize("mask", MASKS)
def test_reference_attention_with_sinks_is_the_softmax_with_one_more_term(mask):
    q, k, v, _ = _qkv()
    segments, window = MASKS[mask]
    got = reference_attention(q, k, v, segments, window=window, sink_logits_H=SINKS)
    np.testing.assert_allclose(got, _by_hand(q, k, v, segments, window, SINKS), rtol=1e-5, atol=1e-6)
    # sinks of -inf are no sinks
    np.testing.assert_allclose(reference_attention(q, k, v, segments, window=window, sink_logits_H=SINKS * 0 - 1e30),
                               reference_attention(q, k, v, segments, window=window), rtol=1e-6, atol=1e-7)


def _output_and_grads(attention, q, k, v, sinks, do):
    out, pullback = jax.vjp(attention, q, k, v, sinks)
    return [out, *pullback(do)]


@pytest.mark.parametrize("mask", ["causal", "packed window"])
def test_flash_kernels_with_sinks_equal_reference(mask, monkeypatch):
    """Local attention (a one-step ring) with the blockwise kernel and cuDNN's
    code (its calls emulated): output and the gradients of q, k, v and the
    sink logits."""
    emulate_cudnn(monkeypatch)
    q, k, v, do = _qkv()
    segments, window = MASKS[mask]
    want = _output_and_grads(
        lambda q, k, v, s: reference_attention(q, k, v, segments, window=window, sink_logits_H=s), q, k, v, SINKS, do)
    for impl in ("blockwise", "cudnn"):
        kernel = AttentionKernel(impl, block_size=8, max_documents=8, window=window)
        got = jax.jit(_output_and_grads, static_argnums=0)(
            lambda q, k, v, s: kernel.local(q, k, v, segments, s), q, k, v, SINKS, do)
        for name, g, w in zip(["out", "dq", "dk", "dv", "d_sinks"], got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=f"{impl} {name}")


def test_bfloat16_sink_logits_get_a_bfloat16_gradient_from_float32_math():
    q, k, v, do = _qkv()
    sinks = SINKS.astype(jnp.bfloat16)
    got = jax.jit(_output_and_grads, static_argnums=0)(
        lambda q, k, v, s: AttentionKernel("blockwise", 8).local(q, k, v, None, s), q, k, v, sinks, do)
    want = _output_and_grads(lambda q, k, v, s: reference_attention(q, k, v, sink_logits_H=s),
                             q, k, v, sinks.astype(jnp.float32), do)
    assert got[4].dtype == jnp.bfloat16
    np.testing.assert_allclose(got[4].astype(jnp.float32), want[4], rtol=1e-2, atol=1e-2)


# The attention block with sinks and Wo's bias: on one device, written out, and run by a method on the mesh.

MODEL = attention_model(8, 2)


def _params(model=MODEL):
    params = attention_params(model)
    keys = jax.random.split(jax.random.key(5), 2)
    return {**params, "attn_sinks": 3.0 * jax.random.normal(keys[0], (model.num_attention_heads,)),
            "bo": 0.5 * jax.random.normal(keys[1], (model.hidden_size,))}


def _plain_block(p, x, positions, segment_ids, model, window):
    """x + attention(norm(x)) + bo with each head's sink in its softmax, written out on one device."""
    h = rms_norm(x, p["attn_norm"], model.rms_norm_eps)
    q, k, v = (jnp.einsum("bsd,dhk->bshk", h, p[name]) for name in ("wq", "wk", "wv"))
    inv_freq = rope_inverse_frequencies(model)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    o = reference_attention(q, k, v, segment_ids, window=window, sink_logits_H=p["attn_sinks"])
    return x + jnp.einsum("bshk,hkd->bsd", o, p["wo"]) + p["bo"]


def _projection(model=MODEL, **fields):
    return dataclasses.replace(blocks.projection_of(model, 4), **{"sinks": True, "output_bias": True, **fields})


def _reference(params, inputs, window=0):
    x, cotangent, positions, segment_ids = inputs
    block = functools.partial(_plain_block, model=MODEL, window=window)
    return jax.jit(value_and_grads, static_argnums=0)(block, params, x, positions, segment_ids, cotangent)


def _on_mesh(params, inputs, mesh_config, U, *, method=ULYSSES, window=0, **projection):
    """The block run by `method` on a mesh of the 8 devices, results in sequence order."""
    x, cotangent, positions, segment_ids = inputs
    mesh = make_mesh(mesh_config, jax.devices())
    layout = SequenceLayout(mesh_config.sp if method is ALLGATHER else mesh_config.ring)
    options = ForwardOptions(shards=MeshShards(mesh), sequence_parallel=method, mlp_tile=4,
                             attention=AttentionKernel("blockwise", 16, window=window), head_stages=H // U)
    tokens, hidden = compute_sharding(mesh, TOKENS), compute_sharding(mesh, HIDDEN)
    block = lambda p, x, pos, seg: blocks.attention(p, x, pos, seg, MODEL, options,  # noqa: E731
                                                    projection=_projection(**projection))
    placed = [jax.device_put(layout.lay_out(x), hidden), jax.device_put(layout.lay_out(positions), tokens),
              None if segment_ids is None else jax.device_put(layout.lay_out(segment_ids), tokens),
              jax.device_put(layout.lay_out(cotangent), hidden)]
    out, d_params, d_x = jax.jit(value_and_grads, static_argnums=0)(block, params, *placed)
    return layout.restore(out), d_params, layout.restore(d_x)


# (mesh, U, method, window, packed): every method and stage layout meets the sinks once.
PATHS = {
    "ulysses sp8 kv replicated": (MeshConfig(sp=8), 8, ULYSSES, 0, False),
    "upipe sp2 U2": (MeshConfig(fsdp=4, sp=2), 2, ULYSSES, 0, False),
    "ulysses x ring packed": (MeshConfig(ring=2, sp=4), 4, ULYSSES, 0, True),
    "allgather sp8 U4": (MeshConfig(sp=8), 4, ALLGATHER, 0, True),
    "ulysses sp4 window": (MeshConfig(fsdp=2, sp=4), 4, ULYSSES, 4, True),
    "ring4 window": (MeshConfig(fsdp=2, ring=4), 4, ULYSSES, 4, True),  # the window: half a zigzag chunk
}


@pytest.fixture(scope="module")
def params():
    return _params()


@pytest.fixture(scope="module")
def inputs():
    return {packed: attention_inputs(MODEL, batch=4, seq=S, packed=packed) for packed in (False, True)}


@pytest.fixture(scope="module")
def references(params, inputs):
    """The one-device block's results by (packed, window), each computed once."""
    return {(packed, window): _reference(params, inputs[packed], window)
            for packed, window in {(path[4], path[3]) for path in PATHS.values()}}


@pytest.mark.parametrize("path", PATHS)
def test_each_sequence_parallel_path_with_sinks_equals_one_device(path, params, inputs, references):
    """Output and every gradient, the sink logits' and bo's included: Ulysses
    with one head per device (kv heads replicated over sp), UPipe stages,
    the ring under Ulysses, all-gather, sliding windows on Ulysses and on
    the ring alone (its halos), packed documents."""
    mesh_config, U, method, window, packed = PATHS[path]
    got = _on_mesh(params, inputs[packed], mesh_config, U, method=method, window=window)
    assert_block_close(got, references[packed, window])


def test_the_output_bias_is_added_once_after_the_stages(params, inputs):
    """Four head stages on one device: with bo the output is the output
    without it plus bo, once (its gradient: the paths above)."""
    x, _, positions, segment_ids = inputs[False]
    options = ForwardOptions(attention=AttentionKernel("blockwise", 16), head_stages=4)

    @functools.partial(jax.jit, static_argnums=0)
    def run(output_bias, p, x):
        return blocks.attention(p, x, positions, segment_ids, MODEL, options,
                                projection=_projection(output_bias=output_bias))

    np.testing.assert_allclose(run(True, params, x), run(False, params, x) + params["bo"], rtol=1e-6, atol=1e-6)


@pytest.fixture
def sinkless_kernel():
    """A kernel registered from outside jlong that has not said it runs sinks, preferred by auto."""
    saved = dict(kernels._KERNELS)
    spec = kernels.register(KernelSpec("no_sinks", lambda a: BlockwiseStep(a.block_size), {}, lambda query: None),
                            preferred=True)
    yield spec
    kernels._KERNELS = saved


@pytest.mark.fast
def test_a_kernel_or_method_without_sinks_is_refused_in_one_line(sinkless_kernel):
    assert not sinkless_kernel.sinks
    for method in (ULYSSES, ALLGATHER):
        for impl in ("auto", "blockwise", "cudnn", "reference"):
            method.check_sinks(impl)
        with pytest.raises(JlongError) as error:
            method.check_sinks("no_sinks")
        message = str(error.value)
        assert "\n" not in message and "attention.impl=no_sinks" in message and "blockwise" in message
    with pytest.raises(JlongError, match="attention.sp_method=mine does not run attention sinks"):
        SequenceParallelMethod("mine", sinks=False).check_sinks("blockwise")
    # At trace time: auto passes the sinkless kernel over for a call with sinks; named, it is refused.
    q, k, v, _ = _qkv()
    assert AttentionKernel("auto", 8).step(q, window=S, sinks=True) == BlockwiseStep(8)
    with pytest.raises(JlongError, match="attention.impl=no_sinks does not run attention sinks"):
        AttentionKernel("no_sinks", 8).local(q, k, v, None, SINKS)


@pytest.mark.fast
def test_auto_chooses_a_kernel_with_sinks_for_a_model_with_them(sinkless_kernel):
    """The run's options: auto passes the preferred sinkless kernel over for GPT-OSS, not for Llama."""
    from helpers import small_config

    from jlong.model.transformer import ForwardOptions
    from jlong.ops.shards import OneDevice

    def chosen(*overrides):
        return ForwardOptions.for_training(small_config(*overrides), OneDevice(), "cpu").attention.impl

    assert chosen("model.preset=tiny-gpt-oss") == "blockwise"
    assert chosen() == "no_sinks"
