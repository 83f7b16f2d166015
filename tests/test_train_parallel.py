"""Sharded training equals the single-device computation; FSDP divides memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlong.config import load_config
from jlong.data.sources import Batches
from jlong.parallel.mesh import make_mesh
from jlong.train.loop import place_batch
from jlong.train.optimizer import make_optimizer
from jlong.train.state import Model
from jlong.train.step import make_loss_fn, make_train_step, opt_state_layout

SMALL_MODEL = [
    "model.vocab_size=128", "model.hidden_size=64", "model.intermediate_size=128",
    "model.num_hidden_layers=2", "model.num_attention_heads=8", "model.num_key_value_heads=4",
    "train.seq_len=64", "train.batch_size=8", "train.compute_dtype=float32", "attention.block_size=16",
    "data.source=synthetic",
]


def small_config(*overrides):
    return load_config(None, [*SMALL_MODEL, *overrides])


def loss_and_grads(config, devices):
    mesh = make_mesh(config.mesh, devices)
    model = Model(config, mesh)
    params = model.init_params(seed=0)
    batch = place_batch(Batches(config).batch(1), mesh)
    loss, grads = jax.jit(jax.value_and_grad(make_loss_fn(model)))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


@pytest.fixture(scope="module")
def single_device_result():
    return loss_and_grads(small_config(), jax.devices()[:1])


@pytest.mark.parametrize("mesh", [(1, 2, 4), (2, 4, 1), (1, 8, 1)], ids=["fsdp2-sp4", "data2-fsdp4", "fsdp8"])
def test_sharded_step_equals_single_device(mesh, single_device_result):
    data, fsdp, sp = mesh
    config = small_config(f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.sp={sp}")
    loss, grads = loss_and_grads(config, jax.devices())
    want_loss, want_grads = single_device_result
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        np.testing.assert_allclose(got, _at(want_grads, path), rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_packed_documents_under_sequence_parallelism():
    """eos-packed batches (segment ids, per-document positions) give the same loss on sp=4."""
    packed = ["data.eos_id=7"]
    single, _ = loss_and_grads(small_config(*packed), jax.devices()[:1])
    sharded, _ = loss_and_grads(small_config(*packed, "mesh.fsdp=2", "mesh.sp=4"), jax.devices())
    np.testing.assert_allclose(sharded, single, rtol=1e-5)


def _state_bytes_per_device(fsdp):
    """Compiled argument bytes of the train step (params + optimizer state + batch)."""
    config = small_config("model.hidden_size=256", "model.intermediate_size=512", f"mesh.fsdp={fsdp}")
    mesh = make_mesh(config.mesh, jax.devices()[:fsdp])
    model = Model(config, mesh)
    optimizer = make_optimizer(config.train)
    opt_shardings, abstract_opt = opt_state_layout(optimizer, model)
    step = make_train_step(model, optimizer, opt_shardings)
    batch = {k: jax.ShapeDtypeStruct(v.shape, jnp.int32) for k, v in Batches(config).batch(1).items()}
    compiled = step.lower(model.abstract_params(), abstract_opt, batch).compile()
    return compiled.memory_analysis().argument_size_in_bytes


def test_fsdp_divides_parameter_and_optimizer_bytes():
    full = _state_bytes_per_device(1)
    for fsdp in (2, 4, 8):
        assert _state_bytes_per_device(fsdp) == pytest.approx(full / fsdp, rel=0.05), fsdp
