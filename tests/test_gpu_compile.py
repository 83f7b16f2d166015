"""The real GPU compiler on a CPU-only machine: XLA:GPU compiles the train step
for compile-only H100s (deviceless), so memory plans, host offload, cuDNN
attention and collectives are checked by the compiler a node would run.

These need the CUDA plugin and cuDNN (`pip install -e '.[gpu-plan]'`, as
.ci/run does); without them they skip, and the skip reason says so."""

import json
import re

import pytest

from helpers import H100, REPO, compiled_step, needs_gpu_compiler, whole_stack

from jlong.config import load_config
from jlong.families import family_of
from jlong.model.remat import remat_policy
from jlong.options import REMAT_NAMES
from jlong.planner.memory import (
    compile_train_step,
    offloaded_attention_bytes,
    plan,
    plan_of,
    saved_layer_input_bytes,
)
from jlong.planner.memory_choice import choose
from jlong.planner.step_cost import step_cost
from jlong.planner.targets import GPUS, PlanTarget, default_budget_gib, target_config_text


def cudnn_attention_calls(hlo: str) -> int:
    return len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo))


@needs_gpu_compiler
def test_whole_stack_compiles_for_h100s_with_cudnn_all_to_all_and_host_offload():
    config = whole_stack()
    step = compiled_step(config)
    hlo = step.text
    assert {d.platform for d in step.compiled.input_shardings[0][0]["embed"].device_set} == {"gpu"}
    assert cudnn_attention_calls(hlo) >= 2  # auto chose cuDNN: its forward and backward kernels
    assert "all-to-all" in hlo
    result = plan_of(step)
    # 2 layers x 2 sequences / (data x fsdp) x 4096 / sp tokens x 256 x bf16: counted by the policy,
    # and what XLA:GPU itself places in host memory.
    assert result.host_offload == saved_layer_input_bytes(config) == 2 * 1 * 1024 * 256 * 2
    assert result.compiler.startswith("XLA:GPU for NVIDIA H100")
    # cuDNN's backward workspace, which deviceless compilation leaves out: a float32 dQ accumulator and
    # softmax sums for 1 sequence x 1 head per device and stage x 4096 tokens x head_dim 64.
    assert result.cudnn_workspace == 1 * 1 * 4096 * (64 + 1) * 4


@needs_gpu_compiler
@pytest.mark.parametrize("remat", [r for r in REMAT_NAMES if not remat_policy(r).offloads_layer_inputs])
def test_every_remat_policy_compiles_for_h100s(remat):
    config = whole_stack(f"memory.remat={remat}")
    result = plan(config, H100)
    assert result.device_total > 0
    assert result.host_offload == 0


@needs_gpu_compiler
def test_two_layers_per_checkpoint_halve_the_host_bytes_xla_gpu_places():
    config = whole_stack("model.num_hidden_layers=4", "memory.layers_per_checkpoint=2")
    result = plan(config, H100)
    # 2 groups of 2 layers x 1 sequence per rank x 1024 local tokens x 256 x bf16
    assert result.host_offload == saved_layer_input_bytes(config) == 2 * 1 * 1024 * 256 * 2


@needs_gpu_compiler
def test_offloaded_optimizer_keeps_its_states_in_host_memory_on_h100s():
    on_device = plan_of(compiled_step(whole_stack()))
    offloaded = plan(whole_stack("memory.optimizer_offload=true"), H100)
    assert offloaded.optimizer_state < 1024 and offloaded.host_states > 0  # on the devices: step counters
    # XLA:GPU's own host bytes hold the offloaded layer inputs and the master parameters and AdamW state,
    # and, at the end of the step, fresh buffers for updated states that XLA does not update in place: at
    # most one more copy of each (0.56-0.79 of the states in this small model, depending on the program;
    # none in the committed long-context configs).
    layer_inputs = saved_layer_input_bytes(whole_stack())
    assert layer_inputs + offloaded.host_states <= offloaded.host_offload <= layer_inputs + 2 * offloaded.host_states
    assert offloaded.parameters == on_device.parameters // 2  # bfloat16 copies of float32 parameters
    assert offloaded.device_total < on_device.device_total


@needs_gpu_compiler
def test_packed_documents_compile_for_h100s_into_cudnn_ragged_calls():
    """Packed documents run in cuDNN's ragged mode: every attention call
    carries the document cap as its segments per sequence, and no score
    block is left to a loop of XLA kernels."""
    config = whole_stack("data.eos_id=0", "attention.max_documents=16", "attention.block_size=512")
    hlo = compile_train_step(config, H100).compiled.as_text()
    calls = re.findall(r'custom_call_target="__cudnn\$fmha[^"]*".*?"max_seg_per_batch": ?(\d+)', hlo)
    assert calls and {int(m) for m in calls} == {16}
    assert re.search(r'"mask_type": ?"PADDING_CAUSAL"', hlo)
    assert "all-to-all" in hlo and "all-gather" in hlo  # segment ids travel along sp
    assert not re.search(r"\[[\d,]*512,512\]\{[^}]*\} dot\(", hlo)  # no [block, block] score matrix


@needs_gpu_compiler
def test_two_nodes_compile_as_one_mesh_with_the_ring_across_them_and_ulysses_inside_each():
    step = compile_train_step(whole_stack("mesh.fsdp=1", "mesh.ring=2"), PlanTarget("h100", gpus_per_node=4))
    assert {d.process_index for d in step.compiled.input_shardings[0][0]["embed"].device_set} == {0, 1}
    assert plan_of(step).devices_per_node == 4
    hlo = step.text
    assert "collective-permute" in hlo and "all-to-all" in hlo
    mesh = step.compiled.input_shardings[0][0]["embed"].mesh
    for ring_rank in range(2):  # each sp group (Ulysses' all-to-all) is one node's 4 GPUs
        assert len({d.process_index for d in mesh.devices[0, 0, ring_rank]}) == 1
    assert {d.process_index for d in mesh.devices[0, 0, :, 0]} == {0, 1}  # the ring spans the nodes


@needs_gpu_compiler
@pytest.mark.parametrize("name, seq_len", [
    pytest.param("llama3-8b-2m", 2 * 2**20, marks=pytest.mark.slow),  # the long tier's: CI chooses at 5M
    ("llama3-8b-5m", 5 * 2**20), ("qwen3-30b-a3b-1m", 2**20)])
def test_the_long_context_configs_fit_their_default_budgets_on_h100(name, seq_len):
    """Three of the committed configs, each with checks of its own (CI runs two; the 2M one is the long
    tier's). Every committed config is planned by experiments/frontier.py (its table:
    experiments/results/frontier.md); the longest plans take minutes each on CI's two cores, so they live
    there rather than here."""
    choice = choose(load_config(REPO / "configs" / f"{name}.yaml"), H100)
    config, step, result = choice.config, choice.chosen.step, choice.chosen.plan
    assert config.train.seq_len == seq_len
    assert result.budget == int(default_budget_gib("h100", config.train.gpu_memory_fraction) * 2**30)
    assert result.fits_device and result.fits_host, result
    if name == "llama3-8b-5m":  # the choice against the default stack (estimates read from the compiled programs)
        [default] = [r for r in choice.references if r.config.heads_per_stage == 8]  # offload_inputs, U = sp
        assert default.config.memory.remat == "offload_inputs" and not default.config.memory.remat_runs
        # 60.54 GiB before the in-place tiles and the normed tiled projections
        assert default.plan.device_total - default.plan.cudnn_workspace < 50 * 2**30, default.plan
        assert default.cost.step_time_s >= 1.05 * choice.chosen.cost.step_time_s
        assert choice.chosen.cost.recompute_factor <= 1.45
    # XLA:GPU's host bytes: the policy's count of layer inputs, and the offloaded optimizer's states
    # (with fresh buffers for updated states that XLA does not update in place: at most one more copy).
    offloaded = saved_layer_input_bytes(config) + offloaded_attention_bytes(config)
    assert offloaded + result.host_states <= result.host_offload <= offloaded + 2 * result.host_states
    if name == "qwen3-30b-a3b-1m":  # set for speed: the attention forward pass runs once; experts priced
        cost = step_cost(step)
        assert cost.recompute_factor <= 1.25 and not cost.unpriced_custom_calls and not cost.unknown_trip_loops
    if name == "llama3-8b-2m":  # the attention forward pass runs once: the fastest setting that fits
        cost = step_cost(step)
        default_stack = load_config(REPO / "configs" / "llama3-8b-5m.yaml", [
            f"train.seq_len={seq_len}", "memory.remat=offload_inputs", "attention.heads_per_stage=8"])
        assert cost.recompute_factor <= 1.25, cost.recompute_factor
        assert step_cost(compile_train_step(default_stack, H100)).step_time_s >= 1.15 * cost.step_time_s


@needs_gpu_compiler
def test_allgather_plans_llama3_8b_at_1m_on_h100_with_its_step_cost():
    """The all-gather method with the committed 5M config's other settings at
    1,048,576 tokens: fits both default budgets, gathers instead of
    exchanging heads, runs attention in cuDNN, and has a step cost."""
    config = load_config(REPO / "configs" / "llama3-8b-5m.yaml",
                         ["train.seq_len=1048576", "attention.sp_method=allgather", "memory.remat=offload_inputs",
                          "attention.heads_per_stage=8"])
    step = compile_train_step(config, H100)
    result = plan_of(step)
    assert result.fits_device and result.fits_host, result
    hlo = step.text
    assert "all-gather" in hlo and "all-to-all" not in hlo
    assert cudnn_attention_calls(hlo) >= 2
    cost = step_cost(step)
    assert cost.step_time_s > 0 and not cost.unpriced_custom_calls
    assert cost.collective_bytes_by_kind.get("all-gather nvlink", 0) > 0
    assert "all-to-all nvlink" not in cost.collective_bytes_by_kind


def _text_proto_fields(text: str) -> dict[str, str]:
    """Scalar fields of a protobuf text, keyed by their dotted path
    (`gpu_device_info.core_count`); repeated fields keep their last value."""
    tokens = re.findall(r'"[^"]*"|[{}]|[^\s:{}]+', re.sub(r"#.*", "", text))
    fields, path, i = {}, [], 0
    while i < len(tokens):
        token = tokens[i]
        if token == "}":
            path.pop()
            i += 1
        elif tokens[i + 1] == "{":
            path.append(token)
            i += 2
        else:
            fields[".".join([*path, token])] = tokens[i + 1].strip('"')
            i += 2
    return fields


DEVICE_FACTS = [
    "threads_per_block_limit", "threads_per_warp", "shared_memory_per_block", "shared_memory_per_core",
    "threads_per_core_limit", "core_count", "fpus_per_core", "block_dim_limit_x", "block_dim_limit_y",
    "block_dim_limit_z", "memory_bandwidth", "l2_cache_size", "clock_rate_ghz", "device_memory_size",
    "shared_memory_per_block_optin", "registers_per_core_limit", "registers_per_block_limit",
    "cuda_compute_capability.major", "cuda_compute_capability.feature_extension",
]
COMPARED = [f"gpu_device_info.{key}" for key in DEVICE_FACTS] + ["platform_name", "device_description_str"]


XLA_FACTS = json.loads((REPO / "tests" / "data" / "xla_gpu_device_facts.json").read_text())["devices"]


@pytest.mark.fast
@pytest.mark.parametrize("gpu", sorted(XLA_FACTS))
def test_target_descriptions_match_xlas_published_ones(gpu):
    """Against the facts of XLA's published descriptions, kept in tests/data (with their source)."""
    ours = _text_proto_fields(target_config_text(GPUS[gpu], (9, 10, 0)))
    assert {key: ours.get(key) for key in COMPARED} == XLA_FACTS[gpu]
    assert XLA_FACTS[gpu]["gpu_device_info.core_count"] == str(GPUS[gpu].sm_count)
    assert ours["dnn_version_info.major"] == "9"  # the installed cuDNN's version, not the file's


@needs_gpu_compiler
def test_gemma3_12b_at_1m_runs_its_windowed_attention_all_in_cudnn():
    """configs/gemma3-12b-1m.yaml as the planner resolves it on h100
    (offload_inputs, U = 8), cut to one period of its layers (5 within
    1,024 tokens, 1 global) so that the suite compiles it in seconds (the
    whole 48 layers: experiments/frontier.py and gemma3_context.py, 2-5
    minutes a plan): it fits both default budgets, and the compiled
    program's cuDNN calls carry exactly the attention FLOPs the windows
    imply, x 18/12 for the forward pass run again under the policy.
    Blockwise attention would count as matmuls; a window cuDNN did not
    apply would price its calls as whole causal ones."""
    config = load_config(REPO / "configs" / "gemma3-12b-1m.yaml",
                         ["memory.remat=offload_inputs", "attention.heads_per_stage=8", "model.num_hidden_layers=6"])
    assert_windowed_attention_all_in_cudnn(config, compile_train_step(config, H100), {"0", "1024"})


def assert_windowed_attention_all_in_cudnn(config, step, windows: set[str]):
    """The step fits both default budgets, its cuDNN calls carry `windows` (0: none) and exactly the attention
    FLOPs the layers' windows imply, x 18/12 for the forward pass run again under the policy."""
    result = plan_of(step)
    assert result.fits_device and result.fits_host, result
    found = re.findall(r'"sliding_window_length": ?(\d+)', step.text)  # in cuDNN calls' configs
    assert set(found) == windows, set(found)
    cost = step_cost(step)
    assert not cost.unpriced_custom_calls
    family, model, S = family_of(config.model), config.model, config.train.seq_len
    attention_per_token = family.flops_per_token(model, S) - family.flops_per_token(model, 0)
    expected = attention_per_token * S / config.mesh.size * 18 / 12
    assert cost.flops_by_kind["attention"] == pytest.approx(expected, rel=0.01)


@needs_gpu_compiler
def test_a_small_gemma3_on_ring_x_sp_compiles_for_h100s_with_cudnn_windows_and_halos():
    """Sliding and global layers on Ulysses 4 x ring 2 in bf16: the chunks'
    causal steps run in cuDNN with its sliding window, the global layers'
    ring steps in cuDNN unmasked, and the halos arrive by collective permute.
    Its step cost prices the rank-dependent halo calls (conditionals)."""
    config = load_config(None, [
        "model.preset=tiny-gemma3", "mesh.ring=2", "mesh.sp=4", "train.seq_len=16384", "train.batch_size=1",
        "attention.impl=auto", "attention.block_size=512", "memory.remat=offload_inputs", "data.source=synthetic",
        "train.compute_dtype=bfloat16"])
    step = compile_train_step(config, H100)
    assert plan_of(step).fits_device
    hlo = step.text
    windows = re.findall(r'"sliding_window_length": ?(\d+)', hlo)  # in cuDNN calls' configs
    assert {"0", "16"} <= set(windows), set(windows)
    assert "collective-permute" in hlo and "all-to-all" in hlo
    cost = step_cost(step)
    assert cost.flops_by_kind["attention"] > 0 and cost.step_time_s > 0


@needs_gpu_compiler
def test_gpt_oss_20b_at_8m_runs_every_attention_call_in_cudnn_with_its_sinks():
    """configs/gpt-oss-20b-8m.yaml cut to two periods of its layers (sliding, full) so that the suite compiles
    it in seconds (the whole 24 layers: experiments/gpt_oss_long_context.py): it fits both default budgets,
    the sliding layers' cuDNN calls carry the 128-token window, and the compiled cuDNN calls carry exactly the
    attention FLOPs the windows imply, x 18/12 for the forward pass run again under the policy (blockwise
    attention would count as matmuls, an unapplied window as whole causal calls). The sinks are trained
    parameters of every layer, their logits applied after each call (numbers: tests/test_attention_sinks.py)."""
    config = load_config(REPO / "configs" / "gpt-oss-20b-8m.yaml", ["model.num_hidden_layers=4"])
    step = compile_train_step(config, H100)
    assert_windowed_attention_all_in_cudnn(config, step, {"0", "128"})
    layer_params = step.compiled.input_shardings[0][0]["layers"]
    assert any("attn_sinks" in run for run in jax_tree_dicts(layer_params)), "no layer trains attn_sinks"


def jax_tree_dicts(tree):
    """Every dict within a pytree of params."""
    if isinstance(tree, dict):
        yield tree
        for value in tree.values():
            yield from jax_tree_dicts(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from jax_tree_dicts(value)
