"""Runs survive crashes and stop cleanly on faults: SIGKILL at random moments,
a diverging loss, out of device memory, and the same losses run to run."""

import os
import random
import signal
import subprocess
import sys
import time

import jax
import pytest
from test_train_loop import MESH, _cli, config_for, losses
from test_train_parallel import SMALL_MODEL

from jlong.checkpoint import Checkpoints
from jlong.errors import JlongError
from jlong.train import loop
from jlong.train.loop import train

LONG_RUN = ["train.steps=16", "checkpoint.every=1"]


def test_same_config_and_seed_give_the_same_losses(tmp_path):
    first = [r["loss"] for r in train(config_for(tmp_path / "a"))]
    second = [r["loss"] for r in train(config_for(tmp_path / "b"))]
    assert first == second


def test_sigkill_at_ten_random_moments_resumes_to_the_same_losses(tmp_path):
    """Killed ten times, at moments drawn from the whole life of the process
    (start-up, compilation, steps, checkpoint writes), the run resumes each
    time and ends with the uninterrupted run's losses."""
    uninterrupted = [r["loss"] for r in train(config_for(tmp_path / "reference", *LONG_RUN))]
    overrides = [*SMALL_MODEL, *MESH, "train.warmup_steps=2", "train.lr=1e-2", *LONG_RUN,
                 f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    command, env = _cli(tmp_path, overrides)
    moments = random.Random(0)
    kills = 0
    while kills < 10:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(moments.uniform(2.0, 9.0))
        if process.poll() is not None:
            break  # finished first: nothing left to interrupt
        process.send_signal(signal.SIGKILL)
        process.wait()
        kills += 1
    assert kills == 10, f"the run finished after {kills} kills; make it longer"
    subprocess.run(command, env=env, check=True, capture_output=True)
    assert losses(tmp_path / "run") == pytest.approx(uninterrupted, rel=1e-6)


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
