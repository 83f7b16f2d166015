"""Training runs end to end: metrics, checkpoints, exact resume, crash safety, processes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_train_parallel import SMALL_MODEL

from jlong.config import config_to_dict, load_config
from jlong.train.loop import train

MESH = ["mesh.fsdp=2", "mesh.sp=4"]


def config_for(tmp_path, *overrides):
    return load_config(None, [
        *SMALL_MODEL, *MESH, "train.steps=6", "train.warmup_steps=2", "train.lr=1e-2",
        f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides,
    ])


def losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return train(config_for(tmp)), tmp / "run"


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return [r["loss"] for r in uninterrupted_run[0]]


def test_metrics_file_and_learning(uninterrupted_run):
    records, run_dir = uninterrupted_run
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_s"} <= set(logged[0])
    assert logged == records
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert (run_dir / "config.yaml").is_file()


def test_resume_continues_exactly(tmp_path, uninterrupted):
    config = config_for(tmp_path, "checkpoint.every=3")
    first = train(config, until_step=3)
    second = train(config)
    assert [r["step"] for r in second] == [4, 5, 6]
    assert [r["loss"] for r in first + second] == uninterrupted
    assert losses(tmp_path / "run") == uninterrupted


def _cli(tmp_path, overrides, *flags):
    """`jlong train` in a subprocess, on a config file holding `overrides`."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(load_config(None, overrides))))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the CLI gives the CPU as many devices as the mesh needs
    return [sys.executable, "-m", "jlong", "train", str(config_file), *flags], env


def test_sigkill_during_checkpoint_write_resumes(tmp_path, uninterrupted):
    """Killed while a checkpoint is being written, the run resumes from the
    previous complete one and ends with the uninterrupted run's losses."""
    overrides = [*SMALL_MODEL, *MESH, "train.steps=6", "train.warmup_steps=2", "train.lr=1e-2",
                 f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=1"]
    command, env = _cli(tmp_path, overrides)
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = tmp_path / "ckpt"
    deadline = time.time() + 240
    while process.poll() is None and time.time() < deadline:
        writing = ckpt.is_dir() and any("tmp" in p.name for p in ckpt.iterdir())
        complete = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
        if writing and complete:  # a second checkpoint is being written
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.002)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    subprocess.run(command, env=env, check=True, capture_output=True)
    assert losses(tmp_path / "run") == pytest.approx(uninterrupted, rel=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path, uninterrupted):
    overrides = [*SMALL_MODEL, *MESH, "train.steps=6", "train.warmup_steps=2", "train.lr=1e-2",
                 f"run_dir={tmp_path / 'run'}"]
    port = _free_port()
    processes = []
    for rank in range(2):
        command, env = _cli(tmp_path, overrides, "--coordinator", f"127.0.0.1:{port}",
                            "--num-processes", "2", "--process-id", str(rank))
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outputs = [p.communicate(timeout=300)[0].decode() for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs[0][-2000:] + outputs[1][-2000:]
    np.testing.assert_allclose(losses(tmp_path / "run"), uninterrupted, rtol=1e-5)


def test_profile_window_writes_a_trace(tmp_path):
    train(config_for(tmp_path, "train.steps=3", "train.profile_start=2", "train.profile_steps=1",
                     "checkpoint.dir=null"))
    assert any((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
