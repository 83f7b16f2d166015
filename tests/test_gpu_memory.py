"""What `jlong train` asks a GPU for, and GPU targets on a machine without the
CUDA plugin; neither needs a GPU."""

import pytest

from jlong import cli
from jlong.planner import targets
from jlong.planner.gpu_memory import MEM_FRACTION_VARIABLE, apply_memory_fraction
from jlong.planner.targets import GIB, GPUS, POOL_RESERVE_GIB, PlanTarget, default_budget_gib

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)


def test_train_sets_the_memory_fraction_it_plans_for():
    environ = {}
    chosen = apply_memory_fraction(0.94, environ)
    assert environ == {MEM_FRACTION_VARIABLE: "0.94"}
    assert chosen.describe() == "XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 (from train.gpu_memory_fraction)"
    # The plan's default budget is that share of the device, less the reserve.
    h100 = GPUS["h100"].memory_bytes / GIB
    assert default_budget_gib("h100", 0.94) == pytest.approx(0.94 * h100 - POOL_RESERVE_GIB)
    assert PlanTarget("h100").device_budget_gib(0.94) == default_budget_gib("h100", 0.94)
    assert PlanTarget("h100", budget_gib=50.0).device_budget_gib(0.94) == 50.0


def test_an_exported_memory_fraction_wins():
    environ = {MEM_FRACTION_VARIABLE: ".5"}
    chosen = apply_memory_fraction(0.94, environ)
    assert environ == {MEM_FRACTION_VARIABLE: ".5"}
    assert chosen.value == ".5" and "exported by you" in chosen.describe()


def test_train_applies_the_fraction_before_jax_starts(tmp_path, monkeypatch):
    """Through the command line: the configured share lands in the environment
    (here the run stops at a bad data path, before any compile)."""
    monkeypatch.delenv(MEM_FRACTION_VARIABLE, raising=False)
    config = tmp_path / "run.yaml"
    config.write_text("model: {preset: tiny-llama}\ntrain: {gpu_memory_fraction: 0.9}\n"
                      f"data: {{source: tokens, path: {tmp_path / 'missing.npy'}}}\n")
    assert cli.main(["train", str(config)]) == 2
    import os

    assert os.environ[MEM_FRACTION_VARIABLE] == "0.9"


@pytest.mark.parametrize("command", ["plan", "maxlen"])
def test_a_gpu_target_without_the_plugin_names_the_install_extra(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(targets, "cuda_plugin_installed", lambda: False)
    config = tmp_path / "run.yaml"
    config.write_text("model: {preset: tiny-llama}\n")
    assert cli.main([command, str(config), "--target", "h100"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "pip install -e \".[gpu-plan]\"" in lines[0] and "--target cpu" in lines[0], lines


def test_without_the_plugin_the_default_target_is_cpu(monkeypatch):
    monkeypatch.setattr(targets, "cuda_plugin_installed", lambda: False)
    assert targets.resolve_target(None) == "cpu"
