"""The cuDNN step kernel's contract with jax's private cuDNN primitives, and
the ragged form it hands them (numerics: test_attention_kernels, test_ring)."""

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from packaging.requirements import Requirement

from jlong.attention import cudnn
from jlong.attention.step import Documents
from jlong.errors import JlongError
from jlong.jax_private import private


@pytest.mark.fast
def test_jlong_admits_the_jax_releases_whose_private_names_it_was_read_against():
    """The installed metadata (what pip decides by) admits 0.10.2, which CI runs, and 0.11.2, which a
    GPU image comes with, and not the next minor release, whose private names nobody has read."""
    [requirement] = [Requirement(r) for r in importlib.metadata.requires("jlong") if Requirement(r).name == "jax"
                     and not Requirement(r).marker]
    assert all(requirement.specifier.contains(v) for v in ("0.10.2", "0.11.0", "0.11.2")), requirement
    assert not any(requirement.specifier.contains(v) for v in ("0.10.1", "0.12.0")), requirement
    assert requirement.specifier.contains(jax.__version__), f"jax {jax.__version__} is outside {requirement}"


@pytest.mark.fast
def test_a_private_name_this_jax_lacks_is_one_line_naming_it_and_the_version(monkeypatch):
    with pytest.raises(JlongError) as caught:
        private("jax._src.cudnn.fused_attention_stablehlo", "_no_such_primitive_p")
    message = str(caught.value)
    assert "\n" not in message
    assert "jax._src.cudnn.fused_attention_stablehlo._no_such_primitive_p" in message
    assert f"jax {jax.__version__}" in message
    # and where the cuDNN kernel binds one, at its first use, not at import
    monkeypatch.setattr(cudnn, "FUSED_ATTENTION", "jax._src.no_such_module")
    cudnn._fused.cache_clear()
    try:
        with pytest.raises(JlongError, match=r"jax\._src\.no_such_module\._dot_product_attention_fwd_p"):
            q = jnp.zeros((1, 8, 2, 8), jnp.bfloat16)
            jax.eval_shape(lambda q: cudnn.fused_forward(q, q, q, None, "CAUSAL", 0.125), q)
    finally:
        cudnn._fused.cache_clear()


@pytest.mark.fast
@pytest.mark.parametrize("ragged", [False, True], ids=["plain", "ragged"])
def test_the_private_cudnn_primitives_take_what_jlong_hands_them(ragged):
    """Abstract evaluation only (no GPU): the primitives' names, parameters and
    shapes as `fused_forward` and `fused_backward` use them."""
    B, T, S, H, K, d, M = 2, 64, 32, 8, 2, 64, 4
    q = jax.ShapeDtypeStruct((B, T, H, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, K, d), jnp.bfloat16)
    lengths = None
    if ragged:
        lengths = cudnn.Ragged(*(jax.ShapeDtypeStruct((B, m), jnp.int32) for m in (M, M, M + 1, M + 1)))
    segments = B * M if ragged else B
    mask = "PADDING_CAUSAL" if ragged else "CAUSAL"
    stats = jax.ShapeDtypeStruct((segments, H, T), jnp.float32)
    for name, call, args, want in [
        ("_dot_product_attention_fwd_p", lambda q, k, v, r: cudnn.fused_forward(q, k, v, r, mask, 0.125),
         (q, kv, kv, lengths), [((B, T, H, d), jnp.bfloat16), ((segments, H, T), jnp.float32)]),
        ("_dot_product_attention_bwd_p",
         lambda q, k, v, r, s, o, do: cudnn.fused_backward(q, k, v, r, mask, 0.125, s, o, do),
         (q, kv, kv, lengths, stats, q, q),
         [((B, T, H, d), jnp.bfloat16), ((B, S, K, d), jnp.bfloat16), ((B, S, K, d), jnp.bfloat16)]),
    ]:
        try:
            got = jax.eval_shape(call, *args)
        except Exception as error:  # noqa: BLE001 - any change of the private API lands here
            pytest.fail(f"jax's private {name} no longer takes what jlong.attention.cudnn hands it: {error!r}")
        assert [(x.shape, x.dtype) for x in got] == want, name


def test_documents_become_cudnns_ragged_form():
    """Row 0 holds documents of 3, 2 and 3 tokens, row 1 one of 8; 4 query
    heads over 2 kv heads of 8 dims. Offsets count elements of each tensor's
    own layout: tokens x 32 for the queries, tokens x 16 for keys and values."""
    B, T, H, K, d, M = 2, 8, 4, 2, 8, 4
    ids = jnp.asarray([[0, 0, 0, 1, 1, 2, 2, 2], [5] * 8])
    q, kv = jnp.zeros((B, T, H, d)), jnp.zeros((B, T, K, d))
    segments = cudnn.CudnnStep(M)._segments(Documents(ids, ids), True, q, kv)
    lengths = [3, 2, 3, 8, 0, 0, 0, 0]
    starts = [0, 3, 5, 8]  # tokens of the flattened batch; then the end (2 x 8), padding
    np.testing.assert_array_equal(segments.ragged.q_seqlen.reshape(-1), lengths)
    np.testing.assert_array_equal(segments.ragged.kv_seqlen.reshape(-1), lengths)
    np.testing.assert_array_equal(segments.ragged.q_offsets.reshape(-1), np.r_[starts, [16] * 6] * H * d)
    np.testing.assert_array_equal(segments.ragged.kv_offsets.reshape(-1), np.r_[starts, [16] * 6] * K * d)
    assert segments.mask == "PADDING_CAUSAL"
    # Per-token statistics round-trip through cuDNN's [B*M, H, T] layout.
    lse = jax.random.normal(jax.random.key(0), (B, H, T))
    stats = segments.stats_of(lse)
    np.testing.assert_array_equal(stats[1, :, :2], lse[0, :, 3:5])  # row 0's second document
    np.testing.assert_array_equal(stats[3], lse[1])
    np.testing.assert_array_equal(segments.lse_of(stats), lse)


def test_an_off_diagonal_step_attends_within_the_document_spanning_the_boundary():
    """Keys of documents 0 and 1, queries of documents 1 and 2 (row 0); row 1's
    queries start a new document, so that row has no segment at all."""
    q_ids = jnp.asarray([[1, 1, 1, 2], [3, 3, 4, 4]])
    k_ids = jnp.asarray([[0, 0, 1, 1], [2, 2, 2, 2]])
    q, kv = jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 4, 1, 8))
    segments = cudnn.CudnnStep(4)._segments(Documents(q_ids, k_ids), False, q, kv)
    assert segments.mask == "PADDING" and bool(segments.any)
    np.testing.assert_array_equal(segments.ragged.q_seqlen.reshape(-1), [3, 0, 0, 0])
    np.testing.assert_array_equal(segments.ragged.kv_seqlen.reshape(-1), [2, 0, 0, 0])
    np.testing.assert_array_equal(segments.ragged.kv_offsets.reshape(-1)[:1], [2 * 8])
    np.testing.assert_array_equal(segments.q_covered_BT, [[1, 1, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(segments.k_covered_BS, [[0, 0, 1, 1], [0, 0, 0, 0]])


def test_the_gpu_check_runs_its_paths_with_the_cuda_calls_emulated(monkeypatch):
    """experiments/gpu_check.py on CPU, cuDNN's calls emulated: what a GPU
    owner will run works end to end (its verdict on cuDNN needs the GPU)."""
    from cudnn_emulation import emulate_cudnn
    from helpers import load_experiment

    gpu_check = load_experiment("gpu_check")

    emulate_cudnn(monkeypatch)
    rows = gpu_check.check_all(64, 4, 2, 16, 3, window=10, print_rows=False)
    assert len(rows) == 7 * 5 and all(row["ok"] for row in rows), rows
    assert {row["path"] for row in rows} >= {"sliding window", "sliding window packed", "sinks sliding window packed"}
    assert gpu_check.main(["--seq-len", "64"]) == 2  # no GPU here
