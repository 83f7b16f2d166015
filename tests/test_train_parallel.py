"""Sharded training equals the single-device computation; FSDP divides memory."""

import jax
import numpy as np
import pytest
from helpers import assert_same_result, loss_and_grads, small_config

from jlong.data.sources import Batches
from jlong.parallel.placement import make_mesh
from jlong.planner.memory import state_bytes
from jlong.program.train_program import TrainProgram


@pytest.fixture(scope="module")
def single_device_result():
    return loss_and_grads(small_config(), jax.devices()[:1])


@pytest.mark.parametrize("mesh", [(1, 2, 4), (2, 4, 1), (1, 8, 1)], ids=["fsdp2-sp4", "data2-fsdp4", "fsdp8"])
def test_sharded_step_equals_single_device(mesh, single_device_result):
    data, fsdp, sp = mesh
    config = small_config(f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.sp={sp}")
    assert_same_result(loss_and_grads(config, jax.devices()), single_device_result)


@pytest.mark.parametrize("stages", [[], ["attention.heads_per_stage=2"], ["attention.heads_per_stage=all"]],
                         ids=["one-kv-head-per-stage", "half-a-group-per-stage", "one-stage"])
def test_allgather_on_fsdp2_sp4_equals_fsdp8(stages):
    """attention.sp_method=allgather (keys and values gathered over sp, zigzag
    layout) gives fsdp 8's loss and gradients, whatever its stage size
    (heads_per_stage need not be a multiple of sp here)."""
    fsdp8 = loss_and_grads(small_config("mesh.fsdp=8", "mesh.sp=1"), jax.devices())
    allgather = small_config("attention.sp_method=allgather", "mesh.fsdp=2", "mesh.sp=4", *stages)
    assert_same_result(loss_and_grads(allgather, jax.devices()), fsdp8)


@pytest.mark.parametrize("mesh", [["mesh.fsdp=2"], ["mesh.ring=2"], ["mesh.fsdp=2", "attention.sp_method=allgather"]],
                         ids=["fsdp2-sp4", "ring2-sp4", "allgather-fsdp2-sp4"])
def test_packed_documents_under_sequence_parallelism(mesh):
    """eos-packed batches (segment ids, per-document positions) give the same loss on sp=4,
    and with a ring (segment ids travel with their keys and values)."""
    packed = ["data.eos_id=7"]
    single, _ = loss_and_grads(small_config(*packed), jax.devices()[:1])
    sharded, _ = loss_and_grads(small_config(*packed, *mesh, "mesh.sp=4"), jax.devices())
    np.testing.assert_allclose(sharded, single, rtol=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("packed", [[], ["data.eos_id=7"]], ids=["plain", "packed"])
def test_the_step_is_built_for_the_batches_the_data_gives(packed):
    config = small_config(*packed, "mesh.fsdp=2", "mesh.sp=4")
    program = TrainProgram(config, make_mesh(config.mesh))
    batch = Batches.from_config(config).batch(1)
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        k: (v.shape, v.dtype) for k, v in program.abstract_batch.items()
    }
    placed = program.place_batch(batch)
    assert all(placed[k].sharding == program.abstract_batch[k].sharding for k in batch)


@pytest.mark.fast
def test_fsdp_divides_parameter_and_optimizer_bytes():
    def per_device(fsdp):
        config = small_config("model.hidden_size=256", "model.intermediate_size=512", f"mesh.fsdp={fsdp}")
        return state_bytes(config, devices=jax.devices()[:fsdp])

    full = per_device(1)
    for fsdp in (2, 4, 8):
        assert per_device(fsdp) == pytest.approx(full / fsdp, rel=0.05), fsdp
