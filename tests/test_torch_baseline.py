"""jlong and the PyTorch baseline (experiments/torch_baseline.py) train the
same Hugging Face Llama (and Qwen3) on the same token file to the same losses."""

import json

import numpy as np
import pytest
from helpers import load_experiment
from hf_models import small_hf_model

from jlong.config import load_config
from jlong.training.loop import train as jlong_train

STEPS = 20
compare, torch_baseline = load_experiment("compare"), load_experiment("torch_baseline")


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runs(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("baseline")
    small_hf_model(request.param).save_pretrained(tmp / "hf")
    rng = np.random.default_rng(0)
    motif = rng.integers(0, 96, size=50)  # repeated, so there is something to learn
    tokens = np.concatenate([motif + rng.integers(0, 2, size=50) for _ in range(40)]).astype(np.int32) % 96
    np.save(tmp / "tokens.npy", tokens)
    overrides = [
        f"model.hf_path={tmp / 'hf'}", "data.source=tokens", f"data.path={tmp / 'tokens.npy'}",
        f"train.steps={STEPS}", "train.seq_len=32", "train.batch_size=2", "train.lr=3e-3",
        "train.warmup_steps=5", "train.compute_dtype=float32", "mesh.fsdp=2", "mesh.sp=4",
        f"run_dir={tmp / 'jlong'}",
    ]
    config = load_config(None, overrides)
    jlong_train(config)
    torch_baseline.train(config, tmp / "torch")
    return tmp


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_losses_agree_at_every_step(runs):
    ours, theirs = read_metrics(runs / "jlong"), read_metrics(runs / "torch")
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, STEPS + 1))
    for a, b in zip(ours, theirs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]  # the issue asks 1e-3; float32 gives ~1e-7
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-6)
    assert ours[-1]["loss"] < 0.85 * ours[0]["loss"]  # it learned, in both


def test_grad_norms_agree(runs):
    ours, theirs = read_metrics(runs / "jlong"), read_metrics(runs / "torch")
    for a, b in zip(ours, theirs):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), a["step"]


def test_compare_prints_side_by_side_and_plots(runs, capsys):
    plot = runs / "losses.png"
    compare.main([str(runs / "jlong"), str(runs / "torch"), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "loss jlong" in out and "loss torch" in out and f"\n{STEPS:>4} " in out
    assert plot.stat().st_size > 1000


@pytest.mark.fast
def test_baseline_refuses_what_it_cannot_match(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("data: {source: synthetic}\n")
    assert torch_baseline.main([str(config), "--run-dir", str(tmp_path / "run")]) == 2
    assert "model.hf_path" in capsys.readouterr().err
