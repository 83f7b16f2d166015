"""The planner on LoRA and QLoRA runs: the frozen base's bytes in its dtype
(a 4-bit base about a quarter of bf16's), gradients and optimizer state of
the adapters alone, model FLOPs without the base's weight gradients, and
`jlong plan` / `jlong maxlen` on one GPU (`--devices 1 --gpus-per-node 1`).

Tiny shapes only; the one-GPU configs themselves are planned whole by
experiments/lora_one_gpu.py (minutes each on a small machine)."""

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import REPO, assert_one_line_error, load_experiment, needs_gpu_compiler, run_cli

from jlong.config import load_config
from jlong.families import family_of
from jlong.planner.advice import lower_memory_settings
from jlong.planner.flops import adapter_params_per_token, model_flops_per_token
from jlong.planner.hlo import parse_instruction
from jlong.planner.memory import GIB, compile_train_step, format_plan, plan, plan_of, state_bytes
from jlong.planner.step_cost import step_cost
from jlong.planner.targets import PlanTarget

# One device, Llama-shaped and small; the vocabulary small so that the layers' matrices are nearly all the base.
ONE_DEVICE = [
    "model.family=llama", "model.vocab_size=64", "model.hidden_size=256", "model.intermediate_size=512",
    "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2", "mesh.sp=1",
    "mesh.fsdp=1", "train.batch_size=1", "train.seq_len=1024", "attention.impl=blockwise",
    "attention.block_size=256", "memory.remat=offload_inputs", "memory.mlp_tile=512", "memory.loss_tile=512",
    "train.compute_dtype=bfloat16", "train.param_dtype=float32",
]
LORA = ["lora.rank=8", "lora.targets=all-linear"]
ONE_GPU = ["--devices", "1", "--gpus-per-node", "1"]


def one_device(*overrides):
    return load_config(None, [*ONE_DEVICE, *overrides])


def matrix_params(config) -> int:
    """The base's linear-layer weights (what NF4 quantizes), all layers."""
    family = family_of(config.model)
    specs = family.layer_params(config.model)
    return sum(math.prod(specs[n].shape) * family.layers_with(config.model, specs[n])
               for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))


def test_a_4bit_base_plans_at_about_a_quarter_of_bf16():
    bf16 = plan(one_device(*LORA))
    nf4 = plan(one_device(*LORA, "lora.base_dtype=nf4"))
    assert bf16.trainable_parameters == nf4.trainable_parameters > 0  # the adapters alike, in float32
    ratio = nf4.frozen_parameters / bf16.frozen_parameters
    assert 0.25 < ratio < 0.30, ratio  # 4.25 bits of 16 for the matrices; embeddings and norms stay 16-bit
    # The matrices' part exactly: codes packed two to a byte and a 16-bit scale per 64 inputs.
    matrices = matrix_params(one_device())
    assert bf16.frozen_parameters - nf4.frozen_parameters == 2 * matrices - (matrices // 2 + 2 * matrices // 64)


def test_gradients_and_optimizer_state_are_the_adapters_alone():
    config = one_device(*LORA)
    result, full = plan(config), plan(one_device())
    adapters = 4 * adapter_params_per_token(config)  # float32
    assert result.trainable_parameters == result.gradients == adapters
    assert result.optimizer_state == pytest.approx(2 * adapters, abs=64)  # AdamW's two moments and a counter
    assert result.frozen_parameters == result.parameters - adapters
    assert full.frozen_parameters == 0 and full.gradients == full.parameters
    assert state_bytes(config) == result.parameters + result.gradients + result.optimizer_state
    assert result.temporaries < full.temporaries  # no base gradients in the step's scratch


@pytest.mark.fast
def test_model_flops_leave_out_the_base_weight_gradients():
    full, config = one_device(), one_device(*LORA)
    model = config.model
    dense = family_of(model).matmul_params_per_token(model)
    # rank 8 x (inputs + outputs) of q, k, v, o, gate, up, down, in each of 2 layers
    D, I, q, kv = 256, 512, 4 * 64, 2 * 64
    adapters = 2 * 8 * ((D + q) + 2 * (D + kv) + (q + D) + 2 * (D + I) + (I + D))
    assert adapter_params_per_token(config) == adapters
    assert model_flops_per_token(full) - model_flops_per_token(config) == pytest.approx(2 * dense - 6 * adapters)


@pytest.mark.fast
def test_advice_for_a_lora_plan_names_the_4bit_base_not_the_offloaded_optimizer():
    bf16 = lower_memory_settings(one_device(*LORA))
    assert "lora.base_dtype=nf4 (the frozen base in 4 bits)" in bf16
    assert not any("optimizer_offload" in knob for knob in bf16)  # a LoRA run refuses it
    nf4 = lower_memory_settings(one_device(*LORA, "lora.base_dtype=nf4"))
    assert not any("base_dtype" in knob or "optimizer_offload" in knob for knob in nf4)
    assert "memory.optimizer_offload=true" in lower_memory_settings(one_device())


@pytest.mark.fast
def test_4bit_arrays_of_a_compiled_program_count_half_a_byte():
    line = "  %p = u4[2,1024,8,128]{3,2,1,0:E(4)} parameter(0)"
    assert parse_instruction(line).bytes == 2 * 1024 * 8 * 128 // 2


def test_plan_and_maxlen_on_one_gpu_with_lora(tmp_path):
    config = tmp_path / "lora.yaml"
    config.write_text("{}\n")
    args = [*ONE_DEVICE, *LORA, "lora.base_dtype=nf4"]
    result = run_cli("plan", str(config), *args, *ONE_GPU, "--target", "cpu", "--budget-gib", "1",
                     "--host-budget-gib", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["devices_per_node"] == 1 and report["fits"]
    assert 0 < report["frozen_parameters"] < report["parameters"] and report["gradients"] < report["parameters"]
    # The longest length within a budget a little over the plan at 1,024 tokens: 2,048 and 1,536 are over.
    budget = report["device_total"] / GIB * 1.001
    found = run_cli("maxlen", str(config), *args, *ONE_GPU, "--target", "cpu", "--budget-gib", f"{budget:.9f}",
                    "--host-budget-gib", "1")
    assert found.returncode == 0, found.stderr
    assert "longest seq_len that fits: 1,024" in found.stdout and "the device budget binds" in found.stdout


def test_a_lora_plan_says_what_it_holds():
    config = one_device(*LORA, "lora.base_dtype=nf4")
    text = format_plan(plan(config), config)
    assert "LoRA rank 8 (alpha 16) on 7 matrices of the layers (all-linear); the frozen base in NF4" in text
    assert "of which frozen base" in text and "of which adapters" in text


@pytest.mark.fast
def test_maxlen_below_the_frozen_base_names_the_4bit_base(tmp_path):
    config = tmp_path / "lora.yaml"
    config.write_text("{}\n")
    result = run_cli("maxlen", str(config), *ONE_DEVICE, *LORA, *ONE_GPU, "--target", "cpu",
                     "--budget-gib", "0.0001")
    assert_one_line_error(result, "0.0001 is below the")
    assert "set lora.base_dtype=nf4" in result.stderr and "optimizer_offload" not in result.stderr


@pytest.mark.fast
@pytest.mark.parametrize("name, base, layers", [("llama3.1-8b-lora-1gpu", "compute", 32),
                                                ("llama3.3-70b-qlora-1gpu", "nf4", 80)])
def test_the_one_gpu_lora_configs(name, base, layers):
    config = load_config(REPO / "configs" / f"{name}.yaml")
    assert config.mesh.size == 1 and config.model.num_hidden_layers == layers
    assert (config.lora.rank, config.lora.targets, config.lora.base_dtype) == (32, ("all-linear",), base)


@needs_gpu_compiler
def test_a_lora_step_executes_at_most_three_quarters_of_full_fine_tunings_flops():
    """At 4,096 tokens, read from the compiled XLA:GPU programs (the planner's
    own accounting: loops times their trip counts). A shape where the
    matmuls dominate: attention, which LoRA leaves as it is, is 8% of the
    FLOPs. Nothing recomputed (remat none), no tiles, one head stage."""
    shape = ["model.family=llama", "model.vocab_size=2048", "model.hidden_size=1024",
             "model.intermediate_size=8192", "model.num_hidden_layers=2", "model.num_attention_heads=8",
             "model.num_key_value_heads=8", "model.head_dim=64", "mesh.sp=1", "train.batch_size=1",
             "train.seq_len=4096", "attention.impl=cudnn", "attention.heads_per_stage=all", "memory.remat=none",
             "memory.mlp_tile=0", "memory.loss_tile=0"]
    target = PlanTarget("h100", gpus_per_node=1)
    full, lora = (step_cost(compile_train_step(load_config(None, [*shape, *extra]), target))
                  for extra in ([], ["lora.rank=16"]))
    assert lora.executed_flops <= 0.75 * full.executed_flops, lora.executed_flops / full.executed_flops
    assert lora.flops_by_kind["attention"] == full.flops_by_kind["attention"]
    # The model FLOPs follow the same convention: 4 per frozen parameter, 6 per adapter parameter.
    assert lora.model_flops < 0.75 * full.model_flops
    assert lora.recompute_factor == pytest.approx(full.recompute_factor, rel=0.05)


@needs_gpu_compiler
def test_a_4bit_base_is_packed_in_the_compiled_program():
    """XLA:GPU's own argument bytes (parameters, optimizer state, batch) equal the planner's, the 4-bit codes
    packed two to a byte."""
    step = compile_train_step(one_device(*LORA, "lora.base_dtype=nf4", "attention.impl=auto"),
                              PlanTarget("h100", gpus_per_node=1))
    result = plan_of(step)
    arguments = step.compiled.memory_analysis().argument_size_in_bytes
    assert arguments == pytest.approx(result.parameters + result.optimizer_state + result.inputs, abs=1024)


def run_gpu_check(*args, timeout=900):
    env = {**os.environ, "JAX_PLATFORMS": ""}  # as a user runs it: jax finds what the machine has
    return subprocess.run([sys.executable, str(REPO / "experiments" / "lora_gpu_check.py"), *args],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)


def test_the_gpu_check_without_a_gpu_says_so_in_one_line():
    result = run_gpu_check()
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "needs a GPU" in lines[0], result.stderr


@pytest.mark.fast
def test_the_gpu_checks_cases_are_the_one_gpu_configs_cut_to_four_layers():
    script = load_experiment("lora_gpu_check")
    for case in script.GPU_CASES:
        config = load_config(REPO / case.config, list(case.overrides))
        assert config.model.num_hidden_layers == 4 and config.lora is not None and config.mesh.size == 1
        whole = load_config(REPO / case.config)
        assert case.run or config.train.seq_len == whole.train.seq_len  # the compile-only cases: the configs' lengths


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_the_gpu_check_rehearsal_compiles_runs_and_reports(tmp_path):
    result = run_gpu_check("--rehearse", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "lora-gpu-check.json").read_text())
    assert data["rehearsal"] and len(data["cases"]) == 3
    for row in data["cases"]:
        assert row["status"] == "ok" and row["compiled_device_bytes"] > 0 and row["planned"]["device_bytes"] > 0
        if row["case"]["run"]:
            assert len(row["step_s"]) == row["case"]["steps"] and all(math.isfinite(x) for x in row["losses"])
    assert "measured / planned" in (tmp_path / "lora-gpu-check.md").read_text()
