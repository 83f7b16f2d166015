"""`jlong plan` and `jlong maxlen`: per-device bytes compiled ahead of time,
linear in the sequence length, and the longest length that fits a budget."""

import json
import math
import re

import jax
import pytest
from helpers import SMALL_LONG, assert_one_line_error, run_cli, small_long

from jlong.errors import JlongError
from jlong.planner.memory import GIB, plan, saved_layer_input_bytes, state_bytes

def test_plan_bytes_grow_linearly_in_sequence_length():
    temporaries = [plan(small_long(f"train.seq_len={n}")).temporaries for n in (8192, 16384, 32768)]
    first_step, second_step = temporaries[1] - temporaries[0], temporaries[2] - temporaries[1]
    assert first_step > 0
    assert second_step == pytest.approx(2 * first_step, rel=0.05)


def test_upipe_plans_below_plain_ulysses():
    heads = ["model.num_attention_heads=32", "model.num_key_value_heads=8", "model.head_dim=32"]
    upipe = plan(small_long(*heads, "attention.heads_per_stage=8"))
    ulysses = plan(small_long(*heads, "attention.heads_per_stage=0"))
    assert upipe.device_total < ulysses.device_total


def test_plan_command_prints_json_bytes(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    result = run_cli("plan", str(config), *SMALL_LONG, "--json", "--target", "cpu")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["target"] == "cpu" and report["compiler"].startswith("XLA:CPU")
    assert report["host_offload"] == 2 * 1024 * 128 * 2  # 2 layers x 1024 local tokens x 128 x bf16
    assert report["host_per_node"] == 8 * report["host_offload"]
    parts = ("parameters", "gradients", "optimizer_state", "inputs", "temporaries", "cudnn_workspace")
    assert report["device_total"] == sum(report[k] for k in parts)
    assert report["fits"] is True


def test_maxlen_command_reports_the_search(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    tiles = ["memory.mlp_tile=1024", "memory.loss_tile=1024"]  # lengths in granules of 8,192: four probes
    budget = math.ceil(plan(small_long(*tiles, "train.seq_len=16384")).device_total / GIB * 1e6) / 1e6
    # Overrides after the options, in the order DESIGN.md gives.
    result = run_cli("maxlen", str(config), "--target", "cpu", "--budget-gib", f"{budget:.6f}", *SMALL_LONG, *tiles)
    assert result.returncode == 0, result.stderr
    assert "seq_len        8,192" in result.stdout and "over the device budget" in result.stdout
    probes = {line.split(":")[0].split()[-1]: line for line in result.stdout.splitlines() if "  seq_len" in line}
    assert list(probes) == ["8,192", "16,384", "32,768", "24,576"]  # doubling, then bisection
    assert "longest seq_len that fits: 16,384" in result.stdout
    assert "over the device budget" in probes["24,576"]  # one granule beyond the longest does not fit
    assert "the device budget binds" in result.stdout


def test_a_plan_over_both_budgets_prints_itself_and_exits_2_naming_them(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    just_the_states = state_bytes(small_long("train.seq_len=1024")) / GIB * 1.001
    result = run_cli("plan", config, *SMALL_LONG, "train.seq_len=1024", "--target", "cpu",
                     "--budget-gib", f"{just_the_states:.9f}", "--host-budget-gib", "1e-6")
    assert "device total" in result.stdout  # the plan itself, then the verdict
    # What it compiles is said before the compile, as jlong train says it (on the GPU target it takes minutes).
    said = result.stdout.splitlines()
    assert said[0].startswith("compiling the train step for 8 devices (data 1 x fsdp 1 x ring 1 x sp 8), 1,024 "
                              "tokens per sequence, with XLA:CPU") and said[1].startswith("compiled 1 program in ")
    assert_one_line_error(result, "at train.seq_len=1,024, ")
    line = result.stderr.strip()
    assert "GiB over the device budget of" in line and "GiB over the host budget of" in line
    assert "memory.remat=save_inputs (layer inputs stay on the devices)" in line  # for the host
    assert "memory.remat=offload_inputs" not in line  # only knobs the config does not use yet


def test_maxlen_where_no_length_fits_exits_2_with_the_shortest_plan(tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    just_the_states = state_bytes(small_long("train.seq_len=1024")) / GIB * 1.001
    result = run_cli("maxlen", config, *SMALL_LONG, "train.seq_len=1024", "--target", "cpu",
                     "--budget-gib", f"{just_the_states:.9f}")
    probe = next(line for line in result.stdout.splitlines() if "seq_len        1,024" in line)
    assert re.fullmatch(r"  seq_len +1,024: +[\d.]+ GiB per device, +[\d.]+ GiB host per node  over the device "
                        r"budget \([\d.]+ s\)", probe), probe  # each probe's compile timed on its line
    assert_one_line_error(result, "at train.seq_len=1,024, ")
    assert "GiB over the device budget of" in result.stderr and "host budget" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--budget-gib", "0"], "--budget-gib must be positive"),
        (["plan", "--budget-gib", "-3"], "--budget-gib must be positive"),
        (["maxlen", "--target", "cpu", "--budget-gib", "0.001"], "below the"),
        (["plan", "--devices", "4"], "--devices 4, but the mesh data x fsdp x ring x sp = 1 x 1 x 1 x 8 = 8"),
        (["plan", "mesh.sp=16"], "not divisible by mesh.sp"),
        (["plan", "memory.mlp_tile=100"], "memory.mlp_tile (100) must divide"),
        (["plan", "--target", "h10"], "unknown --target 'h10' (did you mean 'h100'?)"),
        (["maxlen", "--target", "H2O0"], "did you mean 'h200'?"),
        (["plan", "--host-budget-gib", "0"], "--host-budget-gib must be positive"),
        (["plan", "--gpus-per-node", "3"], "do not fill whole nodes of --gpus-per-node 3"),
        (["plan", "train.gpu_memory_fraction=1.5"], "train.gpu_memory_fraction must be in (0, 1]"),
    ],
)
@pytest.mark.fast
def test_bad_plan_input_exits_2(args, message, tmp_path):
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    command, *rest = args
    assert_one_line_error(run_cli(command, str(config), *SMALL_LONG, *rest), message)


@pytest.mark.fast
def test_plan_on_a_mesh_without_enough_devices_is_refused():
    config = small_long()
    with pytest.raises(JlongError, match="devices are visible"):
        plan(config, devices=jax.devices()[:4])


def test_maxlen_searches_the_settings_left_open_and_names_the_best(tmp_path):
    """Offloaded layer inputs bind the host budget at 16K with one input per
    layer (the search stops there, before the device budget of 1000 GiB);
    one per two layers halves them and reaches further."""
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    base = small_long("memory.mlp_tile=1024", "memory.loss_tile=1024", "train.seq_len=16384")
    host_budget_gib = 8 * saved_layer_input_bytes(base) / GIB  # a node of 8 at 16K, one input per layer
    result = run_cli("maxlen", config, *SMALL_LONG, "memory.mlp_tile=1024", "memory.loss_tile=1024",
                     "train.seq_len=16384", "--target", "cpu", "--budget-gib", "1000",
                     "--host-budget-gib", f"{host_budget_gib:.9f}", "--search", "memory.layers_per_checkpoint=1,2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "setting memory.layers_per_checkpoint=1:" in out and "setting memory.layers_per_checkpoint=2:" in out
    assert "memory.layers_per_checkpoint=1: longest 16,384; the host budget binds" in out
    first = out.split("setting memory.layers_per_checkpoint=2:")[0]
    probes = [line.split(":")[0].split()[-1] for line in first.splitlines() if "  seq_len" in line]
    assert probes == ["16,384", "32,768", "24,576"]  # 16K fits, the 8K granules above it do not
    assert "best setting: memory.layers_per_checkpoint=2" in out
    assert "longest seq_len that fits: 32,768" in out


@pytest.mark.fast
def test_a_malformed_search_is_one_line():
    assert_one_line_error(run_cli("maxlen", "configs/tiny.yaml", "--target", "cpu", "--search", "memory.remat"),
                          "--search 'memory.remat' must look like section.key=value1,value2,...")
