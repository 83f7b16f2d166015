"""The memory stack: each knob (remat policy, tiled MLP, tiled loss, UPipe)
leaves the gradients as they were, and saves the bytes it is there to save."""

import functools

import jax
import numpy as np
import pytest

from helpers import SMALL_MODEL, assert_same_result, load_experiment, loss_and_grads

from jlong.config import ModelConfig, load_config
from jlong.errors import JlongError
from jlong.options import REMAT_NAMES
from jlong.parallel.placement import make_mesh
from jlong.planner.memory import plan, shard_bytes
from jlong.program.train_program import TrainProgram

block_probe = load_experiment("block_probe")  # per-block temporaries, compiled
SHARDED = ["mesh.fsdp=2", "mesh.sp=4"]  # each device holds 16 of the 64 tokens
PLAIN = ["attention.heads_per_stage=0"]  # Ulysses with every head in one stage
ALL_KNOBS = ["memory.remat=save_inputs", "memory.mlp_tile=4", "memory.loss_tile=4", "attention.heads_per_stage=4"]


def sharded_result(*overrides):
    config = load_config(None, [*SMALL_MODEL, *SHARDED, *overrides])
    return loss_and_grads(config, jax.devices())


@pytest.fixture(scope="module")
def knobs_off():
    return sharded_result(*PLAIN)


KNOBS = {
    **{f"remat={policy}": [f"memory.remat={policy}"] for policy in REMAT_NAMES if policy != "none"},
    "mlp_tile=4": ["memory.mlp_tile=4"],
    "loss_tile=4": ["memory.loss_tile=4"],
    "upipe U=C": ["attention.heads_per_stage=4"],
    "all, offloaded": [*ALL_KNOBS, "memory.remat=offload_inputs"],
    "all, save_attention": [*ALL_KNOBS, "memory.remat=save_attention"],
    "all, offload_attention": [*ALL_KNOBS, "memory.remat=offload_attention"],
    "save_inputs, 2 layers per checkpoint": ["memory.remat=save_inputs", "memory.layers_per_checkpoint=2"],
    "all, offloaded, 2 layers per checkpoint": [*ALL_KNOBS, "memory.remat=offload_inputs",
                                                "memory.layers_per_checkpoint=2"],
}


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_knob_leaves_gradients_unchanged(knob, knobs_off):
    assert_same_result(sharded_result(*PLAIN, *KNOBS[knob]), knobs_off)


def test_all_knobs_on_packed_documents():
    packed = ["data.eos_id=7"]
    assert_same_result(sharded_result(*packed, *ALL_KNOBS), sharded_result(*packed, *PLAIN))


def test_tiled_loss_in_bfloat16_is_close_to_untiled():
    """bf16 compute: the tiled loss sums in float32, so it stays as close to
    the float32 loss as the untiled one does."""
    bf16 = ["train.compute_dtype=bfloat16"]
    exact, _ = sharded_result()
    untiled, untiled_grads = sharded_result(*bf16)
    tiled, tiled_grads = sharded_result(*bf16, "memory.loss_tile=4")
    assert abs(tiled - exact) <= 2 * abs(untiled - exact) + 1e-3 * exact
    w_untiled, w_tiled = untiled_grads["embed"], tiled_grads["embed"]
    assert np.linalg.norm(w_tiled - w_untiled) <= 0.02 * np.linalg.norm(w_untiled)


# A Llama-shaped model with Llama 3's 128K vocabulary, narrow enough that the
# logits, not the weights, dominate at a sequence length that compiles fast.
LLAMA_SHAPED = ModelConfig(
    vocab_size=128256, hidden_size=512, intermediate_size=1792, num_hidden_layers=1,
    num_attention_heads=8, num_key_value_heads=8, head_dim=64,
)
LONG_SEQ, SP = 32768, 8


@pytest.mark.fast
def test_tiled_loss_needs_at_most_a_quarter_of_the_untiled_temporaries():
    untiled = block_probe.loss_temp_bytes(LLAMA_SHAPED, LONG_SEQ, SP, tile=0)
    tiled = block_probe.loss_temp_bytes(LLAMA_SHAPED, LONG_SEQ, SP, tile=256)
    assert tiled <= 0.25 * untiled, (tiled, untiled)


def test_tiled_mlp_needs_at_most_half_of_the_untiled_temporaries():
    untiled = block_probe.mlp_temp_bytes(LLAMA_SHAPED, LONG_SEQ, SP, tile=0)
    tiled = block_probe.mlp_temp_bytes(LLAMA_SHAPED, LONG_SEQ, SP, tile=256)
    assert tiled <= 0.5 * untiled, (tiled, untiled)


@functools.cache  # the same plan serves several tests of a worker
def _planned(*overrides):
    activations_dominate = [
        "model.vocab_size=128", "model.hidden_size=64", "model.intermediate_size=128",
        "model.num_attention_heads=8", "model.num_key_value_heads=8",
        "train.seq_len=16384", "train.batch_size=1", "train.compute_dtype=bfloat16",
        "attention.impl=blockwise", "attention.block_size=512", "mesh.sp=8", "memory.loss_tile=512",
    ]
    return plan(load_config(None, [*activations_dominate, *overrides]), devices=jax.devices())


LOCAL_TOKENS, HIDDEN = 16384 // 8, 64


def _growth_per_layer_and_token(remat):
    two, four = (_planned(f"memory.remat={remat}", f"model.num_hidden_layers={n}") for n in (2, 4))
    return (four.temporaries - two.temporaries) / 2 / LOCAL_TOKENS


def test_save_inputs_keeps_one_bfloat16_hidden_vector_per_layer_and_token():
    saved = _growth_per_layer_and_token("save_inputs")
    assert saved <= HIDDEN * 2, saved
    assert _growth_per_layer_and_token("none") > 10 * saved


def test_offloaded_layer_inputs_are_host_bytes():
    """Device temporaries stop growing with depth; the host holds the inputs."""
    assert _growth_per_layer_and_token("offload_inputs") == 0
    saved = _planned("memory.remat=save_inputs", "model.num_hidden_layers=2")
    offloaded = _planned("memory.remat=offload_inputs", "model.num_hidden_layers=2")
    assert saved.host_offload == 0
    assert offloaded.host_offload == saved.saved_layer_inputs == 2 * LOCAL_TOKENS * HIDDEN * 2
    assert offloaded.temporaries == saved.temporaries - offloaded.host_offload


def test_plan_splits_parameters_and_optimizer_state_over_fsdp():
    result = _planned("model.num_hidden_layers=2", "mesh.sp=1", "mesh.fsdp=8", "train.seq_len=512", "train.batch_size=8")
    config = load_config(None, [*SMALL_MODEL[:5], "model.num_key_value_heads=8"])
    whole = shard_bytes(TrainProgram(config, make_mesh(config.mesh, jax.devices()[:1])).abstract_params)
    assert whole / 8 <= result.parameters < whole / 4  # sharded, but for the small replicated norms
    assert result.optimizer_state >= 2 * result.parameters  # AdamW's two float32 moments
    parts = ("parameters", "gradients", "optimizer_state", "inputs", "temporaries", "cudnn_workspace")
    assert result.device_total == sum(getattr(result, part) for part in parts)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["memory.mlp_tile=5"], "memory.mlp_tile (5) must divide the 16 tokens each device holds"),
        (["memory.loss_tile=12"], "nearest that work: 8, 16"),
        (["memory.remat=everything"], "memory.remat"),
        (["memory.remat=save_inputs", "memory.layers_per_checkpoint=3"], "must divide the 2 layers; values that work: 1, 2"),
        (["memory.layers_per_checkpoint=2"], "use it with memory.remat=save_inputs or offload_inputs (got none)"),
        (["memory.layers_per_checkpoint=0"], "memory.layers_per_checkpoint must be positive"),
    ],
)
@pytest.mark.fast
def test_bad_memory_settings_are_refused(overrides, message):
    with pytest.raises(JlongError) as err:
        load_config(None, [*SMALL_MODEL, *SHARDED, *overrides])
    assert message in str(err.value)


@pytest.mark.fast
def test_tiles_split_and_join_back():
    from jlong.ops.tiling import join_tiles, split_tiles

    x = np.arange(2 * 12 * 3).reshape(2, 12, 3)
    tiles = split_tiles(x, 4)
    assert tiles.shape == (3, 2, 4, 3)
    np.testing.assert_array_equal(tiles[1], x[:, 4:8])
    np.testing.assert_array_equal(join_tiles(tiles), x)
