"""experiments/bench.py on CPU: both runs start from one checkpoint and one
token file, and the speed table reports each."""

import os
import subprocess
import sys

import pytest
from helpers import REPO as ROOT

from jlong.planner.targets import cuda_plugin_installed

# Without the 8 virtual devices the tests' conftest gives the CPU: jlong gives
# the runs as many as their one-device mesh needs.
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_speed_table_on_cpu(tmp_path):
    out = tmp_path / "speed.md"
    small = ["model.hidden_size=64", "model.intermediate_size=128", "train.seq_len=64", "train.batch_size=8"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "bench.py"), "speed", str(ROOT / "configs" / "tiny.yaml"), *small,
         "--device", "cpu", "--reps", "1", "--steps", "3", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| jlong", "| torch"))]
    assert len(rows) == 2 and all("failed" not in row for row in rows), rows
    tokens_per_s = [float(row.split("|")[2].replace(",", "")) for row in rows]
    assert all(value > 0 for value in tokens_per_s)
    assert (tmp_path / "work" / "hf" / "config.json").is_file()  # one random checkpoint for both


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_plan_check_on_cpu(tmp_path):
    """A plan and a real run; XLA:CPU measures no peak. The GPU compiler's
    plan (deviceless H100) is there where the CUDA plugin is."""
    config = tmp_path / "one-device.yaml"
    config.write_text(
        "model: {vocab_size: 128, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2,\n"
        "        num_attention_heads: 4, num_key_value_heads: 2}\n"
        "memory: {remat: save_inputs, mlp_tile: 32, loss_tile: 32}\n"
        "train: {batch_size: 1}\n"
    )
    out = tmp_path / "plan_vs_peak.md"
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "plan_check.py"), str(config), "--seq-lens", "128",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=ONE_DEVICE,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.read_text().splitlines() if line.startswith("| 128 ")]
    assert [row[0].strip() for row in rows] == ["128"]
    assert float(rows[0][1]) > 0
    assert all(row[3].strip() == "-" for row in rows)  # no measured peak
    if cuda_plugin_installed():
        assert all(float(row[2]) > 0 for row in rows)
    else:
        assert all(row[2].strip() == "-" for row in rows)
