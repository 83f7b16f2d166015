"""experiments/kernel_race.py: without a GPU it refuses in one line; its CPU rehearsal runs jlong's side of the
race (the Triton kernels interpreted) and writes the results in the form the GPU run does."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO

SCRIPT = REPO / "experiments" / "kernel_race.py"


def run_script(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path):
    result = run_script("--out", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0] and "--rehearse" in lines[0], result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_the_rehearsal_races_jlongs_kernels_and_marks_the_anchors_not_run(tmp_path):
    result = run_script("--rehearse", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "kernel-race.json").read_text())
    assert data["rehearsal"] and data["device"]["platform"] == "cpu" and data["versions"]["jax"]
    rows = data["rows"]
    ours = [r for r in rows if r["impl"].startswith("jlong:") or r["impl"] == "jax"]
    assert {(r["kernel"], r["impl"]) for r in ours} >= {("gated_delta", "jlong:triton"), ("gated_delta", "jlong:chunked"),
                                                       ("grouped_matmul", "jlong:triton"), ("dense_gemm", "jax")}
    assert all(r["status"] == "ok" for r in ours) and {r["pass"] for r in ours} == {"fwd", "fwd+bwd"}
    # the numerics against float32 references: bf16 inputs, so within a few bf16 roundings
    errors = [r["max_rel_error"] for r in ours if r["max_rel_error"] is not None]
    assert errors and max(errors) < 2e-2
    anchors = [r for r in rows if r["impl"] in ("fla", "torch")]
    assert anchors and all(r["status"] == "not run" for r in anchors)
    assert "| gated_delta | jlong:triton | fwd+bwd |" in (tmp_path / "kernel-race.md").read_text()
