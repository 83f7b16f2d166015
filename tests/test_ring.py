"""Ring attention (mesh.ring) equals plain attention: the kernel, the
Ulysses x ring attention block, and the whole training step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from helpers import MESH, assert_one_line_error, assert_same_result, loss_and_grads, run_cli, small_config
from jax.sharding import AxisType, PartitionSpec

from attention_cases import assert_block_close, attention_inputs, attention_model, attention_params, reference_block
from attention_cases import sharded_block
from cudnn_emulation import emulate_cudnn

from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.cudnn import CudnnStep
from jlong.attention.kernels import reference_attention
from jlong.attention.ring import ring_attention
from jlong.attention.methods.base import KEEP_ATTENTION_OUTPUT
from jlong.config import MeshConfig, config_to_dict
from jlong.errors import JlongError
from jlong.options import REMAT_NAMES
from jlong.parallel.placement import make_mesh
from jlong.ops.zigzag import SequenceLayout, chunk_token_index

MESHES = {
    "ring2-sp4": MeshConfig(ring=2, sp=4),
    "ring4-sp2": MeshConfig(ring=4, sp=2),
    "ring8": MeshConfig(ring=8),
    "fsdp2-ring2-sp2": MeshConfig(fsdp=2, ring=2, sp=2),
}


@pytest.mark.fast
def test_zigzag_gives_each_ring_rank_an_early_and_a_late_chunk():
    order = _zigzag_order(16, ring=4)
    assert sorted(order) == list(range(16))
    assert order.reshape(4, 2, 2)[:, :, 0].tolist() == [[0, 14], [2, 12], [4, 10], [6, 8]]
    layout = SequenceLayout(ranks=4)
    x = np.arange(32).reshape(2, 16)
    assert (np.asarray(layout.lay_out(x)) == x[:, order]).all()
    assert (np.asarray(layout.restore(layout.lay_out(x))) == x).all()


def _zigzag_order(seq_len, ring):
    """The sequence index of the token at each position of the layout, as the ring ranks compute them."""
    return np.concatenate([np.asarray(chunk_token_index(rank, ring, seq_len)) for rank in range(ring)])


def _ring_only(R, q, k, v, segments, kernel, window=8):
    """ring_attention over a mesh of R devices, on the zigzag layout, results back in order."""
    order = _zigzag_order(q.shape[1], R)
    mesh = jax.make_mesh((R,), ("ring",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])
    spec = PartitionSpec(None, "ring")

    def per_device(q, k, v, segments):
        return ring_attention(q, k, v, segments, kernel=kernel, axis="ring", size=R, window=window)

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)
    laid = lambda x: None if x is None else x[:, order]  # noqa: E731
    out, pullback = jax.vjp(jax.jit(lambda q, k, v: run(q, k, v, laid(segments))), laid(q), laid(k), laid(v))
    restore = np.argsort(order)
    return lambda do: [np.asarray(x)[:, restore] for x in (out, *pullback(laid(do)))]


# Every pair of ring size, kv layout and mask meets in CI; all eight of R = 2, 4 in the long tier.
BLOCKWISE_CASES = [("blockwise", 2, 1, "packed"), ("blockwise", 2, 4, "causal"), ("blockwise", 4, 1, "causal"),
                   ("blockwise", 4, 4, "packed"), ("blockwise", 8, 1, "packed"), ("blockwise", 8, 4, "causal")] + [
    pytest.param("blockwise", R, kv_heads, mask, marks=pytest.mark.slow)
    for R, kv_heads, mask in ((2, 1, "causal"), (2, 4, "packed"), (4, 1, "packed"), (4, 4, "causal"))]
# cuDNN's code adds segment handling to the ring; each ring size meets it once, with both kv layouts.
CUDNN_CASES = [("cudnn", 2, 1, "packed"), ("cudnn", 4, 4, "packed"), ("cudnn", 8, 1, "packed"),
               ("cudnn", 2, 4, "causal")]


@pytest.mark.parametrize("step, R, kv_heads, mask", BLOCKWISE_CASES + CUDNN_CASES)
def test_ring_kernel_equals_reference_attention(step, R, kv_heads, mask, monkeypatch):
    """With either step kernel (cuDNN's code with an emulation in place of
    its call), in windows of 8 tokens: 2 tiles per zigzag chunk for R = 2,
    1 for R = 4 and 8. Packed rows hold short documents and one longer than a ring
    chunk, so off-diagonal steps both share a document and share none."""
    B, S, H, d = 2, 64, 4, 8
    keys = jax.random.split(jax.random.PRNGKey(R), 4)
    q = jax.random.normal(keys[0], (B, S, H, d))
    k, v = (jax.random.normal(key, (B, S, kv_heads, d)) for key in keys[1:3])
    do = jax.random.normal(keys[3], q.shape)
    segments = None
    if mask == "packed":
        starts = np.random.default_rng(R).random((B, S)) < 0.1
        starts[1, 8:40] = False  # a document over several chunks
        segments = jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)
    if step == "cudnn":
        emulate_cudnn(monkeypatch)
    kernel = BlockwiseStep(4) if step == "blockwise" else CudnnStep(max_documents=16)
    out, pullback = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segments), q, k, v)
    want = [out, *pullback(do)]
    got = _ring_only(R, q, k, v, segments, kernel)(do)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=name)


def test_ring_kernel_in_bfloat16_is_as_close_to_float32_as_plain_attention():
    """bf16: the keys' gradients travel the ring in bf16 (rounded once per hop);
    they stay within twice plain bf16 attention's distance from float32."""
    B, S, H, K, d = 1, 256, 4, 2, 16
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    f32 = [jax.random.normal(key, shape) for key, shape in zip(keys, [(B, S, H, d), (B, S, K, d), (B, S, K, d)])]
    do = jax.random.normal(keys[3], (B, S, H, d)).astype(jnp.bfloat16)
    bf16 = [x.astype(jnp.bfloat16) for x in f32]

    def reference(*qkv):
        out, pullback = jax.vjp(lambda q, k, v: reference_attention(q, k, v), *qkv)
        return [np.asarray(x, np.float32) for x in (out, *pullback(do.astype(out.dtype)))]

    exact = reference(*f32)
    plain = reference(*bf16)
    ring = [np.asarray(x, np.float32) for x in _ring_only(4, *bf16, None, BlockwiseStep(16), window=32)(do)]
    for name, e, p, r in zip(["out", "dq", "dk", "dv"], exact, plain, ring):
        assert np.abs(r - e).max() <= 2 * np.abs(p - e).max() + 1e-3 * np.abs(e).max(), name


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
@pytest.mark.parametrize("mesh, kv_heads", [("ring2-sp4", 1), ("ring4-sp2", 8), ("ring8", 1), ("fsdp2-ring2-sp2", 8)])
def test_ulysses_ring_attention_equals_single_device(mesh, kv_heads, packed):
    """32 query heads; U = C with one kv head (every device's heads share it,
    replicated over sp), U = H with 8, and the other way round on packed
    documents: each mesh meets both U, and both kv layouts meet every U."""
    model = attention_model(32, kv_heads)
    params = attention_params(model)
    inputs = attention_inputs(model, packed=packed)
    U = MESHES[mesh].sp if (kv_heads == 1) != packed else 32
    assert_block_close(sharded_block(model, params, inputs, MESHES[mesh], U), reference_block(model, params, inputs))


@pytest.fixture(scope="module")
def single_device_step():
    return loss_and_grads(small_config(), jax.devices()[:1])


# ring 2 x sp 4 runs the whole step in the cuDNN test below; ring 4 x sp 2 meets the attention block above.
@pytest.mark.parametrize("mesh", ["ring8", "fsdp2-ring2-sp2"])
def test_ring_step_equals_single_device(mesh, single_device_step):
    m = MESHES[mesh]
    config = small_config(f"mesh.fsdp={m.fsdp}", f"mesh.ring={m.ring}", f"mesh.sp={m.sp}")
    assert_same_result(loss_and_grads(config, jax.devices()), single_device_step)


def test_ring_step_with_the_cudnn_kernel_code_equals_single_device(monkeypatch):
    """The whole step on ring 2 x sp 4 with packed documents through the cuDNN
    step kernel (its calls emulated), against the plain single-device step."""
    emulate_cudnn(monkeypatch)
    # One row (the emulation unrolls a loop over B x max_documents) of 5 documents: seed 29's step 1 with end id 3.
    packed = ["data.eos_id=3", "train.batch_size=1", "train.seed=29"]
    want = loss_and_grads(small_config(*packed), jax.devices()[:1])
    config = small_config(*packed, "mesh.fsdp=1", "mesh.ring=2", "mesh.sp=4", "attention.impl=cudnn",
                          "attention.max_documents=8")
    assert_same_result(loss_and_grads(config, jax.devices()), want)


@pytest.mark.parametrize("remat", [policy for policy in REMAT_NAMES if policy not in ("none", "save_inputs")])
def test_ring_step_under_remat_policies_equals_single_device(remat, single_device_step):
    """(`save_inputs` compiles to the same program as `full` in a layer scan.)"""
    config = small_config("mesh.fsdp=1", "mesh.ring=2", "mesh.sp=4", f"memory.remat={remat}")
    assert_same_result(loss_and_grads(config, jax.devices()), single_device_step)


def _ring_temp_bytes(seq_len, R):
    """Compiled per-device temporaries of two stages of ring attention, forward + backward (float32, 4 heads
    of 64)."""
    mesh = jax.make_mesh((R,), ("ring",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])
    spec = PartitionSpec(None, "ring")
    shard = jax.sharding.NamedSharding(mesh, spec)
    q = jax.ShapeDtypeStruct((1, seq_len, 4, 64), jnp.float32, sharding=shard)

    def per_device(q, k, v):
        return ring_attention(q, k, v, None, kernel=BlockwiseStep(256), axis="ring", size=R)

    run = jax.shard_map(per_device, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def stages(q, k, v):
        # As the model runs it: checkpointed attention stages in a scan.
        def stage(x, _):
            return x + jax.checkpoint(run, policy=KEEP_ATTENTION_OUTPUT)(x, k, v), None

        return jax.lax.scan(stage, q, jnp.arange(2))[0]

    def forward_backward(q, k, v):
        out, pullback = jax.vjp(stages, q, k, v)
        return pullback(out)

    return jax.jit(forward_backward).lower(q, q, q).compile().memory_analysis().temp_size_in_bytes


def test_ring_temporaries_grow_linearly_in_length_and_fall_with_the_ring():
    doubled = _ring_temp_bytes(32768, 4) / _ring_temp_bytes(16384, 4)
    assert 1.5 < doubled <= 2.1, doubled
    by_ring = [_ring_temp_bytes(32768, R) for R in (2, 4, 8)]
    assert by_ring[0] > by_ring[1] > by_ring[2], by_ring


@pytest.mark.parametrize("overrides, message", [
    (["mesh.fsdp=1", "mesh.ring=2", "train.seq_len=72"],
     "train.seq_len (72) must be a multiple of 2 x mesh.ring x mesh.sp (16: the zigzag layout"),
    (["mesh.fsdp=1", "mesh.ring=2", "attention.block_size=12"],
     "attention.block_size (12) must divide the 16 tokens of each zigzag chunk"),
    (["mesh.ring=0"], "mesh.ring must be positive"),
])
@pytest.mark.fast
def test_bad_ring_settings_are_one_line_errors(overrides, message, tmp_path):
    with pytest.raises(JlongError) as error:
        small_config(*MESH, *overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
    config = tmp_path / "ring.yaml"
    config.write_text(yaml.safe_dump(config_to_dict(small_config(*MESH))))
    assert_one_line_error(run_cli("plan", str(config), "--target", "cpu", *overrides), message)


@pytest.mark.fast
def test_a_ring_larger_than_the_devices_is_an_error():
    with pytest.raises(JlongError, match="= 16, but 8 devices are visible; make the product 8"):
        make_mesh(MeshConfig(ring=4, sp=4), jax.devices())


@pytest.mark.fast
def test_searching_the_ring_degree_keeps_the_devices():
    from jlong.planner.maxlen import with_overrides

    config = small_config("mesh.fsdp=1", "mesh.sp=8")
    assert with_overrides(config, ["mesh.ring=2"]).mesh == MeshConfig(ring=2, sp=4)
    assert with_overrides(config, ["mesh.ring=4", "mesh.sp=2"]).mesh == MeshConfig(ring=4, sp=2)
    with pytest.raises(JlongError, match="mesh.data"):  # a malformed degree is the config's to report
        with_overrides(config, ["mesh.ring=2", "mesh.data=two"])
