"""The host-memory knobs: `memory.optimizer_offload` (master parameters and
AdamW state in host memory) and `memory.layers_per_checkpoint` train exactly
as the plain run does, resume exactly (on another mesh too), and move the bytes they should."""

import re

import jax
import pytest
from helpers import MESH, SMALL_MODEL, run_config

from jlong.config import load_config
from jlong.errors import JlongError
from jlong.planner.memory import format_plan, plan
from jlong.training.loop import train

FOUR_LAYERS = ["model.num_hidden_layers=4", "train.steps=5"]
# Layer groups with offloaded inputs, then the optimizer in host memory with the rest of the stack,
# on fsdp x sp and on a ring (layer groups with kept inputs: tests/test_memory_stack.py).
VARIANTS = {
    "4 layers per checkpoint, offloaded inputs": ["memory.remat=offload_inputs", "memory.layers_per_checkpoint=4"],
    "all, with UPipe and tiles": ["memory.optimizer_offload=true", "memory.remat=offload_inputs",
                                  "memory.layers_per_checkpoint=2", "attention.heads_per_stage=4",
                                  "memory.mlp_tile=4", "memory.loss_tile=4"],
    "attention kept, offloaded, then groups of offloaded inputs": [
        "memory.remat_runs={save_attention: 1, offload_attention: 1}", "memory.remat=offload_inputs",
        "memory.layers_per_checkpoint=2", "attention.heads_per_stage=4"],
    "the auto choice's mix: attention in host memory, on the device, then offloaded inputs": [
        "memory.remat_runs={offload_attention: 1, offload_inputs_save_attention: 1}", "memory.remat=offload_inputs",
        "attention.heads_per_stage=4"],
    "attention kept for the first layer, recomputed for the rest": [
        "memory.remat_runs={save_attention: 1}", "memory.remat=full"],
    "all, on a ring of 2 x sp 4": ["mesh.fsdp=1", "mesh.ring=2", "memory.optimizer_offload=true",
                                   "memory.remat=offload_inputs", "memory.layers_per_checkpoint=2",
                                   "attention.heads_per_stage=4", "memory.mlp_tile=4", "memory.loss_tile=4"],
}


def losses_of(tmp_path, *overrides, until_step=None):
    return [r["loss"] for r in train(run_config(tmp_path, *FOUR_LAYERS, *overrides), until_step=until_step)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return losses_of(tmp_path_factory.mktemp("plain"), "attention.heads_per_stage=0")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_trains_like_the_plain_run(variant, plain, tmp_path):
    assert losses_of(tmp_path, *VARIANTS[variant]) == pytest.approx(plain, rel=1e-5)


def test_offloaded_optimizer_resumes_on_another_mesh(plain, tmp_path):
    """Checkpointed on fsdp=8, continued on fsdp=2 x sp=4: the host-memory
    state is restored straight into the new mesh's host shardings."""
    overrides = ["memory.optimizer_offload=true", "memory.remat=save_inputs", "memory.layers_per_checkpoint=2",
                 "checkpoint.every=2"]
    first = losses_of(tmp_path, *overrides, "mesh.fsdp=8", "mesh.sp=1", until_step=2)
    rest = losses_of(tmp_path, *overrides)
    assert first + rest == pytest.approx(plain, rel=1e-5)
    assert len(rest) == 3


def test_offloaded_optimizer_plans_its_states_in_host_memory():
    config = load_config(None, [*SMALL_MODEL, *MESH, "train.compute_dtype=bfloat16"])
    on_device = plan(config, devices=jax.devices())
    offloaded = plan(load_config(None, [*SMALL_MODEL, *MESH, "train.compute_dtype=bfloat16",
                                        "memory.optimizer_offload=true"]), devices=jax.devices())
    assert offloaded.optimizer_state < 1024  # AdamW's step counters only
    assert offloaded.parameters == on_device.parameters // 2  # bfloat16 copies of the float32 parameters
    assert offloaded.host_states == 3 * on_device.parameters  # float32 masters and two float32 moments
    assert offloaded.host_offload == offloaded.host_states
    assert offloaded.device_total < on_device.device_total


def test_layer_groups_keep_one_input_per_group():
    config = load_config(None, [*SMALL_MODEL, *MESH, "model.num_hidden_layers=4", "memory.remat=offload_inputs",
                                "memory.layers_per_checkpoint=2"])
    result = plan(config, devices=jax.devices())
    one_input = 4 * 16 * 64 * 4  # sequences per fsdp rank x tokens per sp rank x hidden x float32
    assert result.saved_layer_inputs == result.host_offload == 2 * one_input


def test_layers_in_runs_plan_each_runs_bytes():
    """2 layers offloading their inputs, attention outputs and log-sum-exps, then 2 in one group of offloaded inputs."""
    config = load_config(None, [*SMALL_MODEL, *MESH, "model.num_hidden_layers=4",
                                "memory.remat_runs={offload_attention: 2}", "memory.remat=offload_inputs",
                                "memory.layers_per_checkpoint=2"])
    result = plan(config, devices=jax.devices())
    tokens = 4 * 16  # sequences per fsdp rank x tokens per sp rank
    one_input, one_attention = tokens * 64 * 4, tokens * 8 * (8 * 4 + 4)  # float32; 8 heads of 8, lse in float32
    assert result.saved_layer_inputs == 3 * one_input
    assert result.host_offload == 3 * one_input + 2 * one_attention
    assert "offload_attention for layers 0-1, offload_inputs (one input per 2 layers) for layers 2-3" in \
        format_plan(result, config)


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["memory.remat_runs={save_attention: 1, offload_attention: 3}"],
     "memory.remat_runs covers 4 of the 4 layers: leave some to memory.remat"),
    (["memory.remat_runs={offload_attention: 1}", "memory.remat=offload_inputs", "memory.layers_per_checkpoint=2"],
     "memory.layers_per_checkpoint (2) must divide the 3 layers after memory.remat_runs'; values that work: 1, 3"),
    (["memory.remat_runs={offload: 1}"], "memory.remat_runs names 'offload', which is not a memory.remat policy"),
    (["memory.remat_runs={full: 0}"], "memory.remat_runs gives full 0 layers; each run needs at least 1"),
])
def test_layer_runs_that_do_not_divide_are_one_line(overrides, message):
    with pytest.raises(JlongError, match=re.escape(message)):
        load_config(None, [*SMALL_MODEL, "model.num_hidden_layers=4", *overrides])
