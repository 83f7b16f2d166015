"""The flash kernels equal the reference, values and gradients: the blockwise
one, and the cuDNN one's code with an emulation in place of the cuDNN call."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_emulation import emulate_cudnn

from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.kernels import AttentionKernel, attend, choose_kernel, reference_attention


def blockwise_attention(q, k, v, segment_ids=None, *, block_size):
    return attend(q, k, v, segment_ids, impl="blockwise", block_size=block_size)


def _inputs(seq_len, heads, kv_heads, head_dim=16, batch=2, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, seq_len, heads, head_dim))
    k = jax.random.normal(kk, (batch, seq_len, kv_heads, head_dim))
    v = jax.random.normal(kv, (batch, seq_len, kv_heads, head_dim))
    return q, k, v


def _packed_segments(seq_len, batch=2, seed=0):
    """Random document boundaries, different in each row."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        starts = np.zeros(seq_len, np.int32)
        starts[rng.choice(np.arange(1, seq_len), size=3, replace=False)] = 1
        rows.append(np.cumsum(starts))
    return jnp.asarray(np.stack(rows))


def _output_and_grads(kernel, q, k, v, segments):
    """Output, and the gradient of a fixed random projection of it, in one compile."""

    def run(q, k, v):
        o, pullback = jax.vjp(lambda q, k, v: kernel(q, k, v, segments), q, k, v)
        cotangent = jnp.cos(jnp.arange(o.size, dtype=o.dtype)).reshape(o.shape)
        return o, pullback(cotangent)

    return jax.jit(run)(q, k, v)


def _assert_matches_reference(kernel, q, k, v, segments):
    out, grads = _output_and_grads(kernel, q, k, v, segments)
    want_out, want_grads = _output_and_grads(reference_attention, q, k, v, segments)
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("seq_len", [64, 77])
@pytest.mark.parametrize("packed", [False, True])
def test_blockwise_matches_reference(heads, kv_heads, seq_len, packed):
    q, k, v = _inputs(seq_len, heads, kv_heads)
    segments = _packed_segments(seq_len) if packed else None

    def blockwise(q, k, v, s):
        return blockwise_attention(q, k, v, s, block_size=16)

    _assert_matches_reference(blockwise, q, k, v, segments)


def test_packed_documents_do_not_see_each_other():
    """Changing one document's keys leaves every other document's output unchanged."""
    q, k, v = _inputs(48, 4, 2)
    segments = jnp.asarray(np.repeat([[0, 1, 2]], 2, axis=0).repeat(16, axis=1))
    kernel = jax.jit(lambda v: blockwise_attention(q, k, v, segments, block_size=16))
    out, out2 = kernel(v), kernel(v.at[:, 16:32].add(10.0))
    np.testing.assert_array_equal(out[:, :16], out2[:, :16])
    np.testing.assert_array_equal(out[:, 32:], out2[:, 32:])
    assert not np.allclose(out[:, 16:32], out2[:, 16:32])


def test_blockwise_memory_is_linear_in_sequence():
    """Compiled temporaries of the gradient grow ~linearly with S, not quadratically."""

    def temp_bytes(seq_len):
        q, k, v = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in _inputs(seq_len, 4, 2, head_dim=32, batch=1))
        grad = jax.grad(lambda q, k, v: blockwise_attention(q, k, v, block_size=128).sum(), argnums=(0, 1, 2))
        return jax.jit(grad).lower(q, k, v).compile().memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(2048), temp_bytes(8192)
    assert large <= 4.5 * small, (small, large)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_kernel_code_matches_reference(heads, kv_heads, packed, monkeypatch):
    """Everything of the cuDNN path but the call itself: segments to cuDNN's
    offsets (kv offsets by the kv heads' stride), its statistics to
    log-sum-exps and back, rows outside segments."""
    emulate_cudnn(monkeypatch)
    q, k, v = _inputs(64, heads, kv_heads)
    segments = _packed_segments(64) if packed else None

    def fused(q, k, v, s):
        return attend(q, k, v, s, impl="cudnn", max_documents=4)

    _assert_matches_reference(fused, q, k, v, segments)


@pytest.mark.fast
def test_auto_on_cpu_runs_the_blockwise_kernel():
    q = jnp.zeros((1, 40, 4, 16), jnp.bfloat16)
    assert AttentionKernel("auto", block_size=16).step(q, window=40) == BlockwiseStep(16)


@pytest.mark.parametrize(
    "platform, dtype, seq_len, head_dim, expected",
    [
        ("gpu", "bfloat16", 4096, 128, "cudnn"),
        ("cpu", "bfloat16", 4096, 128, "blockwise"),  # no cuDNN on CPU
        ("gpu", "float32", 4096, 128, "blockwise"),  # cuDNN takes 16-bit inputs only
        ("gpu", "bfloat16", 4097, 128, "blockwise"),  # its training kernels refuse odd lengths
        ("gpu", "bfloat16", 4096, 136, "cudnn"),
        ("gpu", "bfloat16", 4096, 100, "blockwise"),  # head_dim not a multiple of 8
    ],
)
@pytest.mark.fast
def test_auto_chooses_the_kernel_each_platform_runs(platform, dtype, seq_len, head_dim, expected):
    assert choose_kernel("auto", platform=platform, dtype=dtype, seq_len=seq_len, head_dim=head_dim) == expected
    assert choose_kernel("reference", platform=platform, dtype=dtype, seq_len=seq_len, head_dim=head_dim) == "reference"
