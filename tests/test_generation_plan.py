"""`jlong plan --generate`: the caches it reports are the bytes the cache's
shapes and shardings hold on a device; on the GPU compiler it prices the
prefill and a decode step, the step no faster than its HBM floor; bad
requests are one line."""

import pytest
from helpers import H100, assert_one_line_error, needs_gpu_compiler, run_cli, small_config

from jlong.planner.generation import plan_generation
from jlong.planner.targets import PlanTarget

LLAMA = ["mesh.fsdp=2", "mesh.sp=4", "train.seq_len=256", "train.batch_size=2"]


def test_the_caches_are_what_their_shapes_hold_on_a_device():
    config = small_config(*LLAMA)
    planned = plan_generation(config, PlanTarget("cpu"), prompt_tokens=100, new_tokens=20, batch=2, search=False)
    model = config.model
    layers, kv, dtype = model.num_hidden_layers, model.kv_heads * model.dim_per_head, 4  # float32
    rows_per_device, sequence_shards = 2 // 2, 4
    prompt = planned.padded_length // sequence_shards * rows_per_device
    new_slots = 24 // sequence_shards * rows_per_device  # 20 new tokens in whole decode calls of 8
    assert planned.padded_length == 128 and planned.batch == 2
    assert planned.cache == 2 * layers * (prompt + new_slots) * kv * dtype
    assert planned.prefill_peak > planned.parameters and planned.decode_peak > planned.cache
    assert planned.fits and planned.prefill_s is None


@needs_gpu_compiler
def test_on_the_gpu_compiler_a_decode_step_is_priced_above_its_floor():
    config = small_config(*LLAMA, "train.compute_dtype=bfloat16", "attention.impl=auto")
    planned = plan_generation(config, H100, prompt_tokens=200, new_tokens=16, batch=2, search=False)
    assert planned.prefill_s > 0 and planned.decode_step_s >= planned.decode_floor_s > 0
    assert planned.as_dict()["decode_tokens_per_s"] == pytest.approx(2 / planned.decode_step_s)


@pytest.mark.fast
def test_a_prompt_past_the_configured_length_is_one_line(tmp_path):
    result = run_cli("plan", "configs/tiny.yaml", "--generate", "--prompt-tokens", "250", "--new-tokens", "20",
                     "--target", "cpu")
    assert_one_line_error(result, "--prompt-tokens 250 and --new-tokens 20 pass train.seq_len (256), the length the "
                                  "config plans for")
