"""experiments/bench.py on CPU: both runs start from one checkpoint and one
token file, and the speed table reports each."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
