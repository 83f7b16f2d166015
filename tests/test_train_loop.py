"""Training runs end to end: metrics, checkpoints, exact resume, processes,
and the plan compiling the very program the loop runs."""

import json
import signal
import socket
import subprocess
import time

import jax
import numpy as np
import pytest
from helpers import MESH, logged_losses, run_config, small_config, train_command

from jlong.checkpoint import Checkpoints
from jlong.parallel.placement import make_mesh
from jlong.planner.memory import compile_train_step, plan_of
from jlong.training.loop import start, train


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return train(run_config(tmp)), tmp / "run"


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
    config = run_config(tmp_path, "checkpoint.every=3")
    first = train(config, until_step=3)
    second = train(config)
    assert [r["step"] for r in second] == [4, 5, 6]
    assert [r["loss"] for r in first + second] == uninterrupted
    assert logged_losses(tmp_path / "run") == uninterrupted


def test_the_plan_compiles_the_program_the_loop_runs(tmp_path):
    """The loop's start phase and the planner build the same TrainProgram
    class for a config and lower it to the same program, byte for byte."""
    config = small_config(*MESH, f"checkpoint.dir={tmp_path / 'ckpt'}")
    checkpoints = Checkpoints(config.checkpoint.dir)
    run = start(config, make_mesh(config.mesh), checkpoints, last=1)
    checkpoints.close()
    planned = compile_train_step(config, devices=jax.devices())
    assert type(planned.program) is type(run.program)
    assert planned.program.lower().as_text() == run.program.lower().as_text()
    assert planned.compiled.input_shardings == run.compiled.input_shardings
    assert plan_of(planned).parameters > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mesh, signalled", [
    ([], 1),
    # the planner's memory choice, made by each process against the tightest budgets: one program for both
    # the long tier's: CI keeps two processes on the first (a compile of over a minute on its 2 cores)
    pytest.param(["mesh.fsdp=1", "mesh.ring=2", "checkpoint.dir=null", "memory.remat=auto"], None, marks=pytest.mark.slow),
], ids=["fsdp-sp-one-process-signalled", "ring-across-processes-with-the-memory-choice"])
def test_two_processes_train_like_one(tmp_path, uninterrupted, mesh, signalled):
    """4 CPU devices per process; with mesh.ring=2 (x sp=4) the ring's two
    ranks are the two processes. In the first, a SIGTERM sent to process 1
    alone after two steps stops both after the same step, with its checkpoint."""
    config = run_config(tmp_path, *mesh)
    port = _free_port()
    processes = []
    for rank in range(2):
        command, env = train_command(tmp_path, config, "--coordinator", f"127.0.0.1:{port}",
                                     "--num-processes", "2", "--process-id", str(rank))
        processes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    if signalled is not None:
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
            assert all(p.poll() is None for p in processes), "a process ended before the signal"
            time.sleep(0.005)
        processes[signalled].send_signal(signal.SIGTERM)
    outputs = [p.communicate(timeout=300)[0].decode() for p in processes]
    assert all(p.returncode == 0 for p in processes), outputs[0][-2000:] + outputs[1][-2000:]
    losses = logged_losses(tmp_path / "run")
    if signalled is not None:
        assert 2 <= len(losses) < len(uninterrupted)
        assert f"stopped at step {len(losses)} on SIGTERM; checkpoint saved" in outputs[0]
        checkpoints = Checkpoints(tmp_path / "ckpt")
        assert checkpoints.latest_step() == len(losses)
        checkpoints.close()
    np.testing.assert_allclose(losses, uninterrupted[:len(losses)], rtol=1e-5)


def test_profile_window_writes_a_trace(tmp_path):
    train(run_config(tmp_path, "train.steps=3", "train.profile_start=2", "train.profile_steps=1",
                     "checkpoint.dir=null"))
    assert any((tmp_path / "run" / "profile").rglob("*.xplane.pb"))
