"""memory.remat=auto and attention.heads_per_stage=auto: the planner's choice
fills both budgets without exceeding either, is the same from run to run,
and trains exactly as the plain run does."""

import json

import pytest
import yaml
from helpers import MESH, REPO, SMALL_MODEL, run_cli, run_config

from jlong.config import load_config, with_values
from jlong.errors import JlongError
from jlong.planner.memory import attention_output_bytes_per_layer, compile_train_step, plan_of
from jlong.planner.memory_choice import LayerSplit, _split, choose, frugal
from jlong.planner.targets import GIB, PlanTarget
from jlong.training.loop import train

FOUR_LAYERS = [*SMALL_MODEL, *MESH, "model.num_hidden_layers=4"]
AUTO = ["memory.remat=auto", "attention.heads_per_stage=auto"]


@pytest.mark.fast
def test_split_keeps_attention_on_the_device_first_then_in_host_memory():
    # 10 layers, A = I = 100 bytes per device, 8 devices a node.
    assert _split(10, 1, 100, 100, 8, device_room=10 * 200, host_room=0) == LayerSplit(0, 10, all_on_device=True)
    assert _split(10, 1, 100, 100, 8, device_room=10 * 100, host_room=0) == LayerSplit(0, 10, all_on_device=False)
    # Room for 2 outputs on the device (and a quarter of one for split scans), 3 in host memory (800 bytes each).
    assert _split(10, 1, 100, 100, 8, device_room=225, host_room=2400) == LayerSplit(3, 2)
    assert _split(10, 1, 100, 100, 8, device_room=224, host_room=2400) == LayerSplit(3, 1)
    assert _split(10, 1, 100, 100, 8, device_room=25, host_room=799) == LayerSplit(0, 0)
    assert _split(10, 1, 100, 100, 8, device_room=24, host_room=10**9) == LayerSplit(0, 0)  # no room for split scans
    # After a try over the budget, what the count missed stands in for the margin.
    assert _split(10, 1, 100, 100, 8, device_room=300, host_room=0, overhead=150) == LayerSplit(0, 1)


@pytest.mark.fast
def test_split_leaves_the_grouped_layers_a_multiple_of_k():
    # k = 2: a layer taken out of a group brings its own input to host memory (A + I/2 more per device).
    split = _split(10, 2, 100, 100, 8, device_room=25, host_room=3 * 150 * 8)
    assert split == LayerSplit(2, 0)  # 3 would leave 7 layers, not a multiple of 2
    assert _split(4, 2, 100, 100, 8, device_room=10**9, host_room=10**9).skipping == 2  # at least one group stays


@pytest.mark.fast
def test_auto_settings_are_refused_where_a_program_is_built_and_runs_cannot_be_given():
    config = load_config(None, [*FOUR_LAYERS, *AUTO])
    assert config.chooses_layout
    with pytest.raises(JlongError, match="chosen by the planner"):
        config.remat_segments
    with pytest.raises(JlongError, match="chosen by the planner"):
        config.heads_per_stage
    with pytest.raises(JlongError, match="memory.remat=auto chooses memory.remat_runs"):
        load_config(None, [*FOUR_LAYERS, "memory.remat=auto", "memory.remat_runs={offload_attention: 1}"])
    lean = frugal(config)
    assert (lean.memory.remat, lean.memory.layers_per_checkpoint, lean.heads_per_stage) == ("offload_inputs", 2, 4)


def test_choice_within_tight_budgets_fits_both_and_is_stable():
    """Budgets with room for about one attention output on the device and one
    in host memory beside the reference, but not for the parameter slices of
    split scans in so small a model: the try over the device budget is
    counted in, and the choice that fits comes back the same twice."""
    config = load_config(None, [*FOUR_LAYERS, "train.batch_size=2", "memory.remat=auto"])
    every_layer_offloaded = with_values(config, memory={"remat": "offload_inputs"})
    reference = plan_of(compile_train_step(every_layer_offloaded, PlanTarget()))
    A = attention_output_bytes_per_layer(every_layer_offloaded)
    target = PlanTarget(budget_gib=(reference.device_total + 1.6 * A) / GIB,
                        host_budget_gib=(reference.host_per_node + 1.5 * A * reference.devices_per_node) / GIB)
    first, again = choose(config, target), choose(config, target)
    assert first.config == again.config and first.decisions == again.decisions
    chosen = first.chosen.plan
    assert chosen.fits_device and chosen.fits_host, chosen
    tried = [line for line in first.decisions if line.startswith("try ")]
    assert tried and "offload_attention for layer 0" in tried[0], first.decisions
    assert first.decisions[-1].startswith("chosen: ")


def test_without_auto_settings_nothing_is_chosen():
    config = load_config(None, FOUR_LAYERS)
    choice = choose(config, PlanTarget())
    assert choice.config is config and choice.decisions == () and choice.compiles == 1


def test_training_with_the_choice_equals_the_plain_run(tmp_path):
    """On the cpu target's default budgets a small model keeps everything
    (save_attention, every head in one stage); the run trains as the plain
    one does and its config.yaml records the choice."""
    steps = ["train.steps=3"]
    plain = [r["loss"] for r in train(run_config(tmp_path / "plain", *steps))]
    auto = train(run_config(tmp_path / "auto", *steps, *AUTO))
    assert [r["loss"] for r in auto] == pytest.approx(plain, rel=1e-5)
    recorded = yaml.safe_load((tmp_path / "auto" / "run" / "config.yaml").read_text())
    assert recorded["memory"]["remat"] == "save_attention"
    assert recorded["attention"]["heads_per_stage"] == "all"


def test_plan_reports_the_choice_in_json():
    result = run_cli("plan", REPO / "configs" / "tiny.yaml", "memory.remat=auto", "--json")
    assert result.returncode == 0, result.stderr
    choice = json.loads(result.stdout)["memory_choice"]
    assert choice["remat"] == "save_attention" and choice["compiles"] == 2  # the reference, then the choice
    assert choice["decisions"][0].startswith("reference, every layer offload_inputs")
    assert choice["decisions"][-1].startswith("chosen: save_attention")
