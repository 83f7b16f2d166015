"""Runs survive crashes and stop cleanly on faults: SIGKILL at random moments,
a diverging loss, out of device memory, and the same losses run to run."""

import json
import random
import signal
import subprocess
import time
from pathlib import Path

import jax
import pytest
from helpers import MESH, SMALL_MODEL, logged_losses, run_cli, run_config, train_command

from jlong.checkpoint import Checkpoints
from jlong.errors import JlongError
from jlong.train.loop import train
from jlong.train.program import TrainProgram
from jlong.train.run_dir import RunDir

LONG_RUN = ["train.steps=16", "checkpoint.every=1"]


def test_same_config_and_seed_give_the_same_losses(tmp_path):
    first = [r["loss"] for r in train(run_config(tmp_path / "a"))]
    second = [r["loss"] for r in train(run_config(tmp_path / "b"))]
    assert first == second


def _steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def _kill_at(process, run_dir: Path, steps: int, delay: float) -> bool:
    """SIGKILLs `process` `delay` seconds after `steps` steps are logged;
    False if it ended first."""
    deadline = time.monotonic() + 300
    while _steps_logged(run_dir) < steps:
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    time.sleep(delay)
    if process.poll() is not None:
        return False
    process.send_signal(signal.SIGKILL)
    process.wait()
    return True


def test_sigkill_at_ten_random_moments_resumes_to_the_same_losses(tmp_path):
    """Killed ten times, the run resumes each time and ends with the
    uninterrupted run's losses. The moments are drawn from the run's progress,
    not the wall clock, so they fall where they should on a fast or a slow
    machine: during start-up and compilation (before a new step is logged),
    or a few milliseconds after a step is logged, while its checkpoint is
    being written (checkpoint.every=1) or the next step runs."""
    uninterrupted = [r["loss"] for r in train(run_config(tmp_path / "reference", *LONG_RUN))]
    run_dir = tmp_path / "run"
    command, env = train_command(tmp_path, run_config(tmp_path, *LONG_RUN))
    moments = random.Random(0)
    # Step counts at which to kill, never past step 10 of 16, so at least six
    # steps and their checkpoints remain after the last kill's moment.
    at_steps = sorted(moments.randint(0, 10) for _ in range(10))
    for kill, steps in enumerate(at_steps):
        steps = max(steps, _steps_logged(run_dir))
        starting_up = steps == _steps_logged(run_dir)
        delay = moments.uniform(0.0, 1.5) if starting_up else moments.uniform(0.0, 0.2)
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        assert _kill_at(process, run_dir, steps, delay), f"the run ended before kill {kill + 1}"
    subprocess.run(command, env=env, check=True, capture_output=True)
    assert logged_losses(run_dir) == pytest.approx(uninterrupted, rel=1e-6)


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
