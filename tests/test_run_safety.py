"""A run keeps to itself: a checkpoint directory resumes only the run that
wrote it, a fresh start sets an earlier run's outputs aside, and `jlong
eval` and `jlong convert` refuse what does not fit in one line. (Ctrl-C's
stop is tested with the other stop signals, in test_reliability.py.)"""

import hashlib
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import MESH, SMALL_MODEL, assert_one_line_error, logged_losses, run_cli, run_config

from jlong.checkpoint import RUN_RECORD, Checkpoints
from jlong.training.loop import train

SHORT = ["train.steps=4", "checkpoint.every=2"]


def _contents(directory: Path) -> dict[str, str]:
    """Every file under `directory`, by relative path, as a hash of its bytes."""
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*")) if f.is_file()}


def _config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("{}\n")
    return path


def _train_cli(tmp_path, run: str, checkpoint_dir: Path, *overrides):
    return run_cli("train", _config_file(tmp_path), *SMALL_MODEL, *MESH, "train.warmup_steps=2", "train.lr=1e-2",
                   *SHORT, f"run_dir={tmp_path / run}", f"checkpoint.dir={checkpoint_dir}", *overrides)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A run to step 4 in its checkpoint directory (steps 2 and 4 kept)."""
    tmp = tmp_path_factory.mktemp("first")
    result = _train_cli(tmp, "run", tmp / "ckpt")
    assert result.returncode == 0, result.stderr
    return tmp


@pytest.mark.parametrize("change", [["train.lr=2e-2", "train.seq_len=32"], ["model.rope_theta=20000"]],
                         ids=["lr-and-length", "rope"])
def test_another_runs_checkpoint_dir_is_refused_and_left_as_it_was(first_run, tmp_path, change):
    """A new run_dir pointed at the first run's checkpoints, with other
    mathematics: one line naming what differs, and nothing there touched
    (before, this resumed them and checkpoint.keep deleted step 2)."""
    before = _contents(first_run / "ckpt")
    result = _train_cli(tmp_path, "other", first_run / "ckpt", "train.steps=6", *change)
    key = change[0].split("=")[0]
    assert_one_line_error(result, f"holds another run's checkpoints (newest: step 4), written with other "
                                  f"settings: {key} ")
    assert "choose a new checkpoint.dir" in result.stderr
    assert _contents(first_run / "ckpt") == before
    assert not (tmp_path / "other").exists()


def test_the_same_settings_resume_from_a_new_run_dir(first_run, tmp_path):
    """A moved or renamed run_dir with the first run's settings continues its checkpoints, and says so."""
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(first_run / "ckpt"), str(ckpt)], check=True)
    result = _train_cli(tmp_path, "renamed", ckpt, "train.steps=6")
    assert result.returncode == 0, result.stderr
    said = result.stdout.splitlines()
    assert said[:2] == [f"resuming step 4 from {ckpt}", "compiling the train step for 8 devices (data 1 x fsdp 2 x "
                        "ring 1 x sp 4), 64 tokens per sequence ..."]
    assert said[2].startswith("compiled in ") and said[2].endswith(" s")
    assert [json.loads(line)["step"] for line in (tmp_path / "renamed" / "metrics.jsonl").read_text().splitlines()] \
        == [5, 6]
    uninterrupted = logged_losses(first_run / "run")
    assert len(uninterrupted) == 4  # the first run's own metrics are untouched


def test_a_checkpoint_dir_from_before_records_resumes_with_a_note(first_run, tmp_path):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(first_run / "ckpt"), str(ckpt)], check=True)
    (ckpt / RUN_RECORD).unlink()
    result = _train_cli(tmp_path, "run", ckpt, "train.steps=5")
    assert result.returncode == 0, result.stderr
    assert f"checkpoint.dir '{ckpt}' has no record of the run that wrote it (written before jlong kept one): " \
        "resuming without checking its settings" in result.stdout
    assert (ckpt / RUN_RECORD).is_file()  # the run records itself from its first save on


def test_a_record_from_before_families_had_names_resumes(first_run, tmp_path):
    """A record without model.family (written before it existed) is read as
    the family its flags imply, so the same run resumes."""
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(first_run / "ckpt"), str(ckpt)], check=True)
    record = yaml.safe_load((ckpt / RUN_RECORD).read_text())
    assert record["model"].pop("family") == "llama"
    (ckpt / RUN_RECORD).write_text(yaml.safe_dump(record))
    result = _train_cli(tmp_path, "run", ckpt, "train.steps=5")
    assert result.returncode == 0, result.stderr
    assert f"resuming step 4 from {ckpt}" in result.stdout


@pytest.mark.fast
def test_converted_weights_are_not_a_checkpoint_dir(tmp_path):
    """`jlong convert`'s output (step 0, no optimizer state) is refused as a run's checkpoint.dir."""
    ckpt = tmp_path / "converted"
    checkpoints = Checkpoints(ckpt)
    checkpoints.save(0, {"w": np.zeros(2, np.float32)}, model=run_config(tmp_path).model)
    checkpoints.close()
    before = _contents(ckpt)
    assert_one_line_error(_train_cli(tmp_path, "run", ckpt), "holds converted weights (step 0)")
    assert _contents(ckpt) == before


def test_a_fresh_start_sets_the_earlier_runs_outputs_aside(tmp_path):
    """A run_dir whose run kept no checkpoints: starting again moves its
    metrics, config and loss curve to run_dir/earlier (then earlier-2), says
    so, and trains from step 1 into a fresh metrics.jsonl."""
    run = tmp_path / "run"
    config = run_config(tmp_path, "train.steps=3", "checkpoint.dir=null")
    train(config)
    first = (run / "metrics.jsonl").read_bytes()
    result = run_cli("train", _config_file(tmp_path), *SMALL_MODEL, *MESH, "train.warmup_steps=2", "train.lr=1e-2",
                     "train.steps=3", f"run_dir={run}")
    assert result.returncode == 0, result.stderr
    assert f"run_dir '{run}' held an earlier run's outputs (steps 1-3 logged, no checkpoint to resume); " \
        f"moved them to {run / 'earlier'} and starting at step 1" in result.stdout
    assert (run / "earlier" / "metrics.jsonl").read_bytes() == first
    assert sorted(p.name for p in (run / "earlier").iterdir()) == ["config.yaml", "loss.png", "metrics.jsonl"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    train(config)
    assert (run / "earlier-2" / "metrics.jsonl").is_file() and (run / "earlier" / "metrics.jsonl").read_bytes() == first


def test_eval_of_a_checkpoint_of_another_model_is_one_line(first_run, tmp_path):
    tokens = tmp_path / "held_out.npy"
    np.save(tokens, np.arange(1000, dtype=np.int32) % 128)
    result = run_cli("eval", _config_file(tmp_path), *SMALL_MODEL, *MESH, "model.hidden_size=96",
                     f"eval.path={tokens}", "eval.passkey_trials=0", "--checkpoint", first_run / "ckpt")
    assert_one_line_error(result, "holds params of another layout than this config makes")
    assert "saved, " in result.stderr and "configured" in result.stderr


def test_convert_says_what_it_wrote_with_normal_permissions_and_never_overwrites(first_run, tmp_path):
    mask = os.umask(0o022)
    try:
        result = run_cli("convert", first_run / "ckpt", tmp_path / "hf")
    finally:
        os.umask(mask)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote {tmp_path / 'hf'}, a Hugging Face checkpoint: config.json, "
                                    "model.safetensors (")
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    before = _contents(tmp_path / "hf")
    assert_one_line_error(run_cli("convert", first_run / "ckpt", tmp_path / "hf"), "is not an empty directory")
    assert _contents(tmp_path / "hf") == before
