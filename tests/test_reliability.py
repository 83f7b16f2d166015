"""Runs survive crashes and stop cleanly on faults: SIGKILL at random moments,
the cluster's stop signals and Ctrl-C, a diverging loss, out of device memory, and the
same losses run to run."""

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import jax
import pytest
from helpers import (MESH, SMALL_MODEL, assert_stopped_with_a_checkpoint, logged_losses, run_cli, run_config,
                     steps_logged, train_command, wait_for_steps)

from jlong.checkpoint import Checkpoints
from jlong.errors import JlongError
from jlong.training.loop import train
from jlong.program.train_program import TrainProgram
from jlong.training.run_dir import RunDir

LONG_RUN = ["train.steps=16", "checkpoint.every=1"]


def test_same_config_and_seed_give_the_same_losses(tmp_path):
    first = [r["loss"] for r in train(run_config(tmp_path / "a"))]
    second = [r["loss"] for r in train(run_config(tmp_path / "b"))]
    assert first == second


def _kill_at(process, run_dir: Path, steps: int, delay: float) -> bool:
    """SIGKILLs `process` `delay` seconds after `steps` steps are logged;
    False if it ended first."""
    deadline = time.monotonic() + 300
    while steps_logged(run_dir) < steps:
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    time.sleep(delay)
    if process.poll() is not None:
        return False
    process.send_signal(signal.SIGKILL)
    process.wait()
    return True


@pytest.fixture(scope="module")
def uninterrupted_long_run(tmp_path_factory):
    return [r["loss"] for r in train(run_config(tmp_path_factory.mktemp("reference"), *LONG_RUN))]


def test_sigkill_at_random_moments_resumes_to_the_same_losses(tmp_path, uninterrupted_long_run):
    """Killed six times, the run resumes each time and ends with the
    uninterrupted run's losses. The moments are drawn from the run's progress,
    not the wall clock, so they fall where they should on a fast or a slow
    machine: during start-up and compilation (before a new step is logged),
    or a few milliseconds after a step is logged, while its checkpoint is
    being written (checkpoint.every=1) or the next step runs."""
    run_dir = tmp_path / "run"
    command, env = train_command(tmp_path, run_config(tmp_path, *LONG_RUN))
    moments = random.Random(0)
    # Step counts at which to kill, never past step 10 of 16, so at least six
    # steps and their checkpoints remain after the last kill's moment.
    at_steps = sorted(moments.randint(0, 10) for _ in range(6))
    for kill, steps in enumerate(at_steps):
        steps = max(steps, steps_logged(run_dir))
        starting_up = steps == steps_logged(run_dir)
        delay = moments.uniform(0.0, 1.5) if starting_up else moments.uniform(0.0, 0.2)
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert _kill_at(process, run_dir, steps, delay), f"the run ended before kill {kill + 1}"
    subprocess.run(command, env=env, check=True, capture_output=True)
    assert logged_losses(run_dir) == pytest.approx(uninterrupted_long_run, rel=1e-6)


def _signal_at(process, run_dir: Path, steps: int, delay: float, signals: list) -> None:
    """Sends `signals` (each after its own delay) once `steps` steps are logged and `delay` seconds more."""
    wait_for_steps(process, run_dir, steps, delay, signal.SIGTERM)
    for pause, signum in signals:
        time.sleep(pause)
        process.send_signal(signum)


@pytest.mark.slow  # CI keeps the SIGKILL case; signals at random moments are the long tier's
def test_stop_signals_at_random_moments_save_and_resume_to_the_same_losses(tmp_path, uninterrupted_long_run):
    """SIGTERM or SIGUSR1 at start-up, during a step, and right after a step,
    while its checkpoint is written (with a second signal 10 ms later): each
    time the run exits 0 with one line naming the step, the checkpoint of that
    step is there, and the run resumed from it ends with the uninterrupted
    run's losses, exactly."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    command, env = train_command(tmp_path, run_config(tmp_path, *LONG_RUN))
    moments = random.Random(1)
    stops = [  # (steps logged, then seconds, then the signals with their pauses)
        (0, moments.uniform(0.0, 1.0), [(0.0, signal.SIGTERM)]),  # start-up: imports, compilation
        (3, moments.uniform(0.0, 0.1), [(0.0, signal.SIGUSR1)]),  # a step under way
        (6, 0.0, [(0.0, signal.SIGTERM), (0.01, signal.SIGTERM)]),  # the checkpoint of step 6 being written
        (6, moments.uniform(0.0, 1.0), [(0.0, signal.SIGTERM)]),  # a resumed run's start-up
    ]
    for steps, delay, signals in stops:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _signal_at(process, run_dir, max(steps, steps_logged(run_dir)), delay, signals)
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-2000:]
        assert_stopped_with_a_checkpoint(out, signals[0][1].name, run_dir, checkpoints)
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert logged_losses(run_dir) == uninterrupted_long_run


@pytest.mark.slow  # CI keeps the SIGKILL case; Ctrl-C at random moments is the long tier's
def test_ctrl_c_at_random_moments_saves_and_resumes_to_the_same_losses(tmp_path, uninterrupted_long_run):
    """The first Ctrl-C stops after the step under way with its checkpoint
    and exit status 130, whether it comes during start-up, mid-step or while a
    checkpoint is written; a second Ctrl-C quits at once, without saving. The
    run resumed each time ends with the uninterrupted run's losses, exactly."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "ckpt"
    command, env = train_command(tmp_path, run_config(tmp_path, *LONG_RUN))
    moments = random.Random(2)
    stops = [  # (steps logged, then seconds, then Ctrl-Cs with their pauses)
        (0, moments.uniform(0.0, 1.0), [0.0]),  # start-up: imports, compilation
        (3, moments.uniform(0.0, 0.1), [0.0]),  # a step under way
        (6, 0.0, [0.0]),  # the checkpoint of step 6 being written
        (8, moments.uniform(0.0, 0.1), [0.0, 0.01]),  # twice: quits at once
    ]
    for steps, delay, pauses in stops:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_steps(process, run_dir, max(steps, steps_logged(run_dir)), delay, signal.SIGINT)
        for pause in pauses:
            time.sleep(pause)
            process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=300)
        if len(pauses) == 2:
            assert process.returncode == -signal.SIGINT, err[-2000:]
            assert "stopped at step" not in out
            continue
        assert process.returncode == 130, err[-2000:]
        assert "jlong: Ctrl-C: stopping " in err and "Ctrl-C again quits at once without saving" in err
        assert_stopped_with_a_checkpoint(out, "SIGINT", run_dir, checkpoints)
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert logged_losses(run_dir) == uninterrupted_long_run


def test_diverging_loss_stops_keeps_the_last_good_checkpoint(tmp_path):
    config = tmp_path / "diverging.yaml"
    config.write_text("{}\n")
    result = run_cli("train", config, *SMALL_MODEL, *MESH, "train.steps=6", "train.warmup_steps=1",
                     "train.lr=1e30", "train.grad_clip=0", "checkpoint.every=1",
                     f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    message = result.stderr.strip().splitlines()[-1]  # after the progress bar's lines
    assert message.startswith("jlong: error: step ") and "is not finite" in message
    bad_step = int(message.split("step ")[1].split(":")[0])
    assert bad_step >= 2
    assert f"the last good checkpoint is step {bad_step - 1}" in message
    checkpoints = Checkpoints(tmp_path / "ckpt")
    assert checkpoints.latest_step() == bad_step - 1  # nothing written for the bad step
    checkpoints.close()
    assert len(logged_losses(tmp_path / "run")) == bad_step - 1


def test_out_of_memory_names_the_plan_and_the_settings_that_fit(tmp_path, monkeypatch):
    planners_compile = TrainProgram.compile

    def compile_out_of_memory(self, compiler_options=None):
        """The loop's compile (no options) runs out of memory; the planner's,
        for the report (XLA:CPU options), does not."""
        if compiler_options is None:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 96.00GiB.")
        return planners_compile(self, compiler_options)

    monkeypatch.setattr(TrainProgram, "compile", compile_out_of_memory)
    with pytest.raises(JlongError) as error:
        train(run_config(tmp_path))
    message = str(error.value)
    assert message.startswith("out of device memory compiling the train step: the plan needs ")
    assert "GiB per device (parameters" in message
    assert "memory.remat=offload_inputs" in message and "memory.loss_tile=" in message
    assert "\n" not in message


@pytest.mark.fast
def test_resume_drops_a_metrics_line_cut_short_by_a_crash(tmp_path):
    config = run_config(tmp_path)
    run_dir = RunDir(config)
    run_dir.start(resumed_at=0)
    for step in (1, 2, 3):
        run_dir.log({"step": step, "loss": 1.0})
    with run_dir.metrics_path.open("a") as f:
        f.write('{"step": 4, "lo')  # the process died inside this write
    RunDir(config).start(resumed_at=2)
    assert [json.loads(line)["step"] for line in run_dir.metrics_path.read_text().splitlines()] == [1, 2]
