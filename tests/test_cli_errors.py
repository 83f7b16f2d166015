"""Bad input through the real command line: exit status 2, one line, no traceback,
and an existing run directory left byte-for-byte as it was."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hf_models import small_hf_model

GOOD = "model:\n  preset: llama3.2-1b\n  num_hidden_layers: 1\nrun_dir: {run}\n"


def run_cli(*args):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "jlong", *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def workspace(tmp_path):
    """A run directory from an earlier run, and a config that points at it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {hidden_size: 1}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    config = tmp_path / "good.yaml"
    config.write_text(GOOD.format(run=run))
    hf_dir = tmp_path / "hf"
    small_hf_model("llama").save_pretrained(hf_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    hf_config["hidden_size"] = 32
    bad_hf = tmp_path / "bad_hf"
    small_hf_model("llama").save_pretrained(bad_hf)
    (bad_hf / "config.json").write_text(json.dumps(hf_config))
    np.save(tmp_path / "tokens2d.npy", np.zeros((4, 4), np.int32))
    np.save(tmp_path / "short.npy", np.zeros(10, np.int32))
    np.save(tmp_path / "floats.npy", np.zeros(5000, np.float32))
    np.save(tmp_path / "big_ids.npy", np.full(5000, 999_999, np.int64))
    (tmp_path / "malformed.yaml").write_text("model: [\n")
    return tmp_path


CASES = {
    "unknown key": (["train", "{cfg}", "train.setps=3"], "did you mean 'train.steps'"),
    "malformed yaml": (["train", "{tmp}/malformed.yaml"], "cannot parse"),
    "missing config": (["train", "{tmp}/nope.yaml"], "does not exist"),
    "kv heads": (["train", "{cfg}", "model.num_key_value_heads=3"], "multiple of model.num_key_value_heads"),
    "missing hf files": (["train", "{cfg}", "model.hf_path={tmp}/empty"], "has no config.json"),
    "hf shape mismatch": (["convert", "{tmp}/bad_hf", "{tmp}/out"], "has shape"),
    "token file missing": (["train", "{cfg}", "data.source=tokens", "data.path={tmp}/none.npy"], "does not exist"),
    "token file 2-D": (["train", "{cfg}", "data.source=tokens", "data.path={tmp}/tokens2d.npy"], "1-D integer"),
    "token file short": (["train", "{cfg}", "data.source=tokens", "data.path={tmp}/short.npy"], "fewer than one sample"),
    "different run": (["train", "{cfg}", "train.steps=1", "train.seq_len=64", "train.batch_size=1"], "belongs to a different configuration"),
    "bad flag": (["train", "{cfg}", "--frobnicate"], "unrecognized arguments: --frobnicate (see 'jlong train --help')"),
    "stray argument after a flag": (["plan", "{cfg}", "--json", "extra"], "unrecognized arguments: extra"),
    "wrong type": (["train", "{cfg}", "train.steps=many"], "train.steps must be an integer"),
    "zero count": (["train", "{cfg}", "train.batch_size=0"], "train.batch_size must be positive"),
    "negative lr": (["train", "{cfg}", "train.lr=-1e-3"], "train.lr must be positive"),
    "seq_len vs sp": (["train", "{cfg}", "mesh.sp=8", "train.seq_len=1001"], "nearest valid: 1000 or 1008"),
    "heads vs sp": (["train", "{cfg}", "mesh.sp=8", "attention.heads_per_stage=12"], "values that work: 8, 16, 32"),
    "tile": (["train", "{cfg}", "mesh.sp=8", "train.seq_len=2048", "memory.loss_tile=100"], "nearest that work: 64, 128"),
    "token ids": (["train", "{cfg}", "data.source=tokens", "data.path={tmp}/big_ids.npy"], "outside the model's vocabulary"),
    "float tokens": (["train", "{cfg}", "data.source=tokens", "data.path={tmp}/floats.npy"], "1-D integer"),
    "budget below states": (["maxlen", "{cfg}", "--budget-gib", "0.5"], "below the"),
    "zero budget": (["plan", "{cfg}", "--budget-gib", "0"], "--budget-gib must be positive"),
    "devices": (["plan", "{cfg}", "--devices", "3"], "--devices 3, but the mesh"),
    "bad command": (["fly"], "invalid choice"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_one_line(name, workspace):
    args, message = CASES[name]
    (workspace / "empty").mkdir(exist_ok=True)
    args = [a.format(cfg=workspace / "good.yaml", tmp=workspace) for a in args]
    before = {p.name: p.read_bytes() for p in (workspace / "run").iterdir()}
    result = run_cli(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jlong: error: "), result.stderr
    assert message in lines[0]
    assert "Traceback" not in result.stderr
    assert {p.name: p.read_bytes() for p in (workspace / "run").iterdir()} == before
