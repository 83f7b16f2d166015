"""experiments/gpu_truth.py: its CPU rehearsal runs the whole pipeline (so the GPU run cannot rot between the
rare sessions that have a GPU), and without a GPU the real run refuses in one line."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, load_experiment

from jlong.config import load_config

SCRIPT = REPO / "experiments" / "gpu_truth.py"


def run_script(*args, timeout=600):
    env = {**os.environ, "JAX_PLATFORMS": ""}  # as a user runs it: jax finds what the machine has
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


@pytest.mark.fast
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2():
    result = run_script()
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0] and "--rehearse" in lines[0], result.stderr


@pytest.mark.fast
@pytest.mark.parametrize("script", ["gpu_kernels.py", "kernel_tiles.py"])
def test_the_gpu_only_kernel_scripts_refuse_without_a_gpu_in_one_line(script):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, str(REPO / "experiments" / script)], capture_output=True, text=True,
                            cwd=REPO / "experiments", env=env, timeout=300)
    lines = [line for line in result.stderr.strip().splitlines() if "needs a GPU" in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr


@pytest.mark.fast
def test_every_gpu_case_is_a_valid_config_of_its_model():
    """The GPU run's cases (which the rehearsal replaces by the tiny model's) load as configs of their models."""
    setup = load_experiment("gpu_truth").Setup(False, None, None)
    cases = setup.cases()
    assert {case["model"] for case in cases} == {"qwen3.5-0.8b", "qwen3.5-35b-a3b 4 layers 128 experts", "llama3.2-1b"}
    families = {load_config(setup.config, case["overrides"]).model.family for case in cases}
    assert families == {"llama", "qwen3_5_text", "qwen3_5_moe_text"}


@pytest.mark.slow  # the GPU run rehearsed end to end, as the long tier's other rehearsals
def test_the_rehearsal_plans_trains_and_measures_what_the_gpu_run_does(tmp_path):
    result = run_script("--rehearse", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "gpu-truth.json").read_text())
    assert {"device", "versions", "cudnn_checks", "kernel_checks", "cases", "rates"} <= data.keys()
    assert data["rehearsal"] and data["device"]["platform"] == "cpu" and data["versions"]["jax"]
    assert data["cudnn_checks"] and not any(check["run"] for check in data["cudnn_checks"])
    # Qwen3.5's kernels (the Triton grouped matmul interpreted) within bounds of their float32 references
    checks = data["kernel_checks"]
    assert {c["kernel"] for c in checks} == {"grouped matmul", "gated delta rule"}
    assert all(c["ok"] and c["error"] > 0 for c in checks), checks

    cases = data["cases"]
    for case in cases:
        assert {"name", "model", "seq_len", "memory", "planned_bytes", "measured_peak_bytes", "estimated_step_s",
                "measured_step_s"} <= case.keys()
        assert "failed" not in case and "plan_failed" not in case, case
        assert case["measured_step_s"] > 0 and case["planned_bytes"] > 0
    # each memory setting is planned and trained on its own: the two plan different bytes
    planned = {case["memory"]: case["planned_bytes"] for case in cases}
    assert len(cases) == len(planned) == len(set(planned.values())) == 2, cases

    rates = data["rates"]
    assert len(rates) >= 10 and all(r["measured"] > 0 and r["assumed"] > 0 for r in rates), rates
    run = data["user_run"]
    assert run["loss_finite"] and run["loss_falling"], run
    text = (tmp_path / "gpu-truth.md").read_text()
    assert "rehearsal" in text and str(tmp_path) not in text  # no absolute path of this machine


@pytest.mark.fast
def test_a_carried_copy_names_its_commit_when_told(monkeypatch):
    """The GPU machine's copy of the checkout may carry a stale git history; the command names the commit."""
    common = load_experiment("common")
    monkeypatch.delenv("JLONG_SOURCE_COMMIT", raising=False)
    own = common.commit()
    monkeypatch.setenv("JLONG_SOURCE_COMMIT", "abc1234")
    assert common.commit() == "abc1234" and own and own != "abc1234"


@pytest.mark.fast
def test_a_commit_is_marked_changed_by_its_code_not_by_the_results_a_script_rewrites(monkeypatch, tmp_path):
    common = load_experiment("common")
    monkeypatch.delenv("JLONG_SOURCE_COMMIT", raising=False)
    monkeypatch.setattr(common, "ROOT", tmp_path)
    monkeypatch.setattr(common, "RESULTS", tmp_path / "experiments" / "results")
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    results, code = tmp_path / "experiments" / "results" / "r.md", tmp_path / "experiments" / "script.py"
    results.write_text("before\n")
    code.write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for command in (["init", "-q"], ["add", "."], ["commit", "-qm", "first"]):
        subprocess.run([*git, *command], check=True)
    results.write_text("after\n")
    assert "+changes" not in common.commit()
    code.write_text("x = 2\n")
    assert common.commit().endswith("+changes")
