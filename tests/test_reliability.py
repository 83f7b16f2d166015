"""Runs survive crashes and stop cleanly on faults: SIGKILL at random moments,
a diverging loss, out of device memory, and the same losses run to run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from test_train_loop import MESH, _cli, config_for, losses
from test_train_parallel import SMALL_MODEL

from jlong.checkpoint import Checkpoints
from jlong.errors import JlongError
from jlong.train import loop
from jlong.train.loop import train
from jlong.train.run_dir import RunDir

LONG_RUN = ["train.steps=16", "checkpoint.every=1"]


def test_same_config_and_seed_give_the_same_losses(tmp_path):
    first = [r["loss"] for r in train(config_for(tmp_path / "a"))]
    second = [r["loss"] for r in train(config_for(tmp_path / "b"))]
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
    uninterrupted = [r["loss"] for r in train(config_for(tmp_path / "reference", *LONG_RUN))]
    run_dir = tmp_path / "run"
    overrides = [*SMALL_MODEL, *MESH, "train.warmup_steps=2", "train.lr=1e-2", *LONG_RUN,
                 f"run_dir={run_dir}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    command, env = _cli(tmp_path, overrides)
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
    assert losses(run_dir) == pytest.approx(uninterrupted, rel=1e-6)


def test_diverging_loss_stops_keeps_the_last_good_checkpoint(tmp_path):
    overrides = [*SMALL_MODEL, *MESH, "train.steps=6", "train.warmup_steps=1", "train.lr=1e30",
                 "train.grad_clip=0", "checkpoint.every=1",
                 f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    command, env = _cli(tmp_path, overrides)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("jlong: error: step ") and "is not finite" in message and "Traceback" not in result.stderr
    bad_step = int(message.split("step ")[1].split(":")[0])
    assert bad_step >= 2
    assert f"the last good checkpoint is step {bad_step - 1}" in message
    checkpoints = Checkpoints(tmp_path / "ckpt")
    assert checkpoints.latest_step() == bad_step - 1  # nothing written for the bad step
    checkpoints.close()
    assert len(losses(tmp_path / "run")) == bad_step - 1


class _OutOfMemoryStep:
    """Stands in for the jitted step: compiling it runs out of memory."""

    def lower(self, *args):
        return self

    def compile(self):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 96.00GiB.")


def test_out_of_memory_names_the_plan_and_the_settings_that_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "make_train_step", lambda *args: _OutOfMemoryStep())
    with pytest.raises(JlongError) as error:
        train(config_for(tmp_path))
    message = str(error.value)
    assert message.startswith("out of device memory compiling the train step: the plan needs ")
    assert "GiB per device (parameters" in message
    assert "memory.remat=offload_inputs" in message and "memory.loss_tile=" in message
    assert "\n" not in message


def test_mesh_that_does_not_match_the_devices_is_refused(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {preset: llama3.2-1b, num_hidden_layers: 1}\nmesh: {fsdp: 2, sp: 2}\n")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    result = subprocess.run([sys.executable, "-m", "jlong", "train", str(config)],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "= 4, but 8 devices are visible; make the product 8" in result.stderr


def test_resume_drops_a_metrics_line_cut_short_by_a_crash(tmp_path):
    config = config_for(tmp_path)
    run_dir = RunDir(config)
    run_dir.start(resumed_at=0)
    for step in (1, 2, 3):
        run_dir.log({"step": step, "loss": 1.0})
    with run_dir.metrics_path.open("a") as f:
        f.write('{"step": 4, "lo')  # the process died inside this write
    RunDir(config).start(resumed_at=2)
    assert [json.loads(line)["step"] for line in run_dir.metrics_path.read_text().splitlines()] == [1, 2]
