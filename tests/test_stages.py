"""A run in stages (`stages:`): a curriculum of lengths and layouts in one
run that trains exactly as its stages would by hand, resumes in any stage,
logs each step's length, and refuses what a stage may not change."""

import json
import signal
import subprocess

import jax
import numpy as np
import pytest
import yaml
from helpers import (H100, SMALL_MODEL, WHOLE_STACK, assert_one_line_error, logged_losses, needs_gpu_compiler, run_cli,
                     run_config, steps_logged, train_command, wait_for_steps)

from jlong.checkpoint import Checkpoints
from jlong.config.stages import config_at_step, stage_runs
from jlong.config import load_config
from jlong.data.sources import Batches
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram
from jlong.errors import JlongError
from jlong.planner.memory import plan
from jlong.planner.targets import gpu_devices
from jlong.training.dry_run import stage_plans
from jlong.training.loop import check_stages_fit, train

# Steps 1-2 at 32 tokens on fsdp 2 x sp 4; steps 3-4 at 64 on a ring 2 x sp 4 with a new RoPE base.
STAGES = ("stages=[{until_step: 2, set: {train.seq_len: 32}}, {until_step: 4, set: {train.seq_len: 64, "
          "mesh.fsdp: 1, mesh.ring: 2, model.rope_theta: 20000.0}}]")


def staged(tmp_path, *overrides):
    return run_config(tmp_path, "train.steps=4", "checkpoint.every=1", STAGES, *overrides)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged")
    return train(staged(tmp)), tmp


def test_a_staged_run_trains_as_its_stages_would_by_hand(uninterrupted):
    """The same updates as running each stage's program in turn, the
    parameters and optimizer state carried from one to the next."""
    records, tmp = uninterrupted
    assert [(r["step"], r["seq_len"]) for r in records] == [(1, 32), (2, 32), (3, 64), (4, 64)]
    by_hand, params, opt_state = [], None, None
    for stage in stage_runs(staged(tmp)):
        program = TrainProgram(stage.config, make_mesh(stage.config.mesh))
        if params is None:
            params = program.init_params(stage.config.train.seed)
            opt_state = program.init_opt_state(params)
        params = jax.device_put(params, program.rest_shardings)
        opt_state = jax.device_put(opt_state, program.opt_shardings)
        step_fn, batches = program.compile(), Batches.from_config(stage.config)
        for step in range(stage.first, stage.last + 1):
            params, opt_state, metrics = step_fn(params, opt_state, program.place_batch(batches.batch(step)))
            by_hand.append(float(np.asarray(metrics["loss"].addressable_data(0))))
    assert [r["loss"] for r in records] == pytest.approx(by_hand, rel=1e-6)
    assert records[2]["loss"] != records[1]["loss"]


def test_a_staged_run_resumes_in_its_later_stage(uninterrupted, tmp_path, capsys):
    records, _ = uninterrupted
    train(staged(tmp_path), until_step=3)
    resumed = train(staged(tmp_path))
    said = capsys.readouterr().out
    assert "resuming step 3 from" in said and "stage 2 of 2: steps 3-4 at seq_len 64" in said
    assert [r["step"] for r in resumed] == [4]
    assert logged_losses(tmp_path / "run") == [r["loss"] for r in records]
    lengths = [json.loads(line)["seq_len"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lengths == [32, 32, 64, 64]


def test_changing_the_stages_is_another_run(uninterrupted, tmp_path):
    _, tmp = uninterrupted
    config = tmp_path / "run.yaml"
    changed = yaml.safe_load((tmp / "run" / "config.yaml").read_text())
    changed["stages"][1]["set"]["train.seq_len"] = 128
    config.write_text(yaml.safe_dump(changed))
    assert_one_line_error(run_cli("train", config), "belongs to a different configuration: stages changed")


@pytest.mark.fast
@pytest.mark.parametrize("stages, message", [
    ("[{until_step: 4, set: {train.steps: 8}}]", "stages[0].set: train.steps is the whole run's, not a stage's"),
    ("[{until_step: 4, set: {model.hidden_size: 32}}]", "model.hidden_size is the whole run's"),
    ("[{until_step: 4, set: {train.weight_decay: 0.0}}]", "train.weight_decay is the whole run's"),
    ("[{until_step: 4, set: {memory.optimizer_offload: true}}]", "memory.optimizer_offload is the whole run's"),
    ("[{until_step: 3, set: {}}, {until_step: 2, set: {}}]", "stages[1].until_step (2) must come after"),
    ("[{until_step: 3, set: {}}]", "the last stage ends at step 3, train.steps is 4"),
    ("[{until_step: 4, set: {train.seq_lne: 64}}]", "stages[0].set: unknown config key 'train.seq_lne'"),
    ("[{until_step: 4, set: {train.seq_len: 33}}]", "stages[0]: train.seq_len (33) must be a multiple of mesh.sp"),
    ("[{until_step: 4, set: {mesh.fsdp: 1}}]", "every stage runs on the run's 8 devices; stage 1's mesh has 4"),
])
def test_what_a_stage_may_not_set_is_one_line(stages, message, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("model: {preset: llama3.2-1b, num_hidden_layers: 1}\nmesh: {fsdp: 2, sp: 4}\n")
    assert_one_line_error(run_cli("plan", config, "train.steps=4", "train.seq_len=64", f"stages={stages}"),
                          message)


def test_plan_reports_every_stage_and_leads_with_the_costliest(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": {"preset": "llama3.2-1b", "num_hidden_layers": 1}}))
    result = run_cli("plan", config, "mesh.fsdp=2", "mesh.sp=4", "train.steps=4", "train.seq_len=64",
                     "train.batch_size=2", "stages=[{until_step: 2, set: {train.seq_len: 64}}, "
                     "{until_step: 4, set: {train.seq_len: 256}}]", "--target", "cpu", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [s["seq_len"] for s in report["stages"]] == [64, 256] and report["stage"] == 2
    assert report["device_total"] == report["stages"][1]["device_total"] > report["stages"][0]["device_total"]


def test_a_stage_that_changes_the_mesh_trains_as_one_that_does_not(uninterrupted, tmp_path):
    records, _ = uninterrupted
    same_mesh = ("stages=[{until_step: 2, set: {train.seq_len: 32}}, {until_step: 4, set: {train.seq_len: 64, "
                 "model.rope_theta: 20000.0}}]")
    kept = train(run_config(tmp_path, "train.steps=4", "checkpoint.dir=null", same_mesh))
    np.testing.assert_allclose([r["loss"] for r in kept], [r["loss"] for r in records], rtol=1e-5)


def test_each_stage_ends_with_an_evaluation_and_its_checkpoint_names_the_stage(tmp_path):
    held_out = tmp_path / "held_out.npy"
    np.save(held_out, (np.arange(4000) * 7 % 128).astype(np.int32))
    records = train(staged(tmp_path, f"eval.path={held_out}", "eval.passkey_trials=0", "checkpoint.keep=4"))
    assert [("eval_loss" in r, r["stage"]) for r in records] == [(False, 1), (True, 1), (False, 2), (True, 2)]
    assert records[1]["eval_loss_by_position"][-1]["end"] == 32 and records[3]["eval_loss_by_position"][-1]["end"] == 64
    checkpoints = Checkpoints(tmp_path / "ckpt")
    assert checkpoints.meta(4)["stage"] == 2 and checkpoints.meta(2)["stage"] == 1
    checkpoints.close()


@pytest.mark.slow  # CI resumes killed runs in test_reliability; a killed curriculum is the long tier's
def test_a_staged_run_killed_mid_stage_resumes_exactly(uninterrupted, tmp_path):
    """SIGKILL a few milliseconds after step 3 (stage 2) is logged, then the same command."""
    records, _ = uninterrupted
    command, env = train_command(tmp_path, staged(tmp_path))
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_steps(process, tmp_path / "run", 3, 0.005, signal.SIGTERM)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert steps_logged(tmp_path / "run") < 4, "the run finished before it was killed"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert logged_losses(tmp_path / "run") == [r["loss"] for r in records]


def test_a_stage_that_cannot_fit_is_refused_before_the_first_step(tmp_path):
    """On a GPU the run plans every stage against the device pool at launch
    (here the CPU's devices with a budget that the longer stage exceeds)."""
    stages = stage_runs(staged(tmp_path))
    shorter = plan(stages[0].config, devices=jax.devices()).device_total
    check_stages_fit(stages[:1], jax.devices(), shorter + 1)
    with pytest.raises(JlongError, match=r"^stage 2 \(steps 3-4\) does not fit: at train.seq_len=64, "):
        check_stages_fit(stages, jax.devices(), shorter + 1)


def test_a_staged_runs_checkpoint_is_evaluated_with_its_stages_settings(uninterrupted, tmp_path):
    """`jlong eval run_dir/config.yaml` reads the stage of the checkpoint's
    step (its length, mesh, RoPE base); the command line's overrides win."""
    _, tmp = uninterrupted
    config = staged(tmp)
    at_step_3 = config_at_step(config, 3, ["mesh.ring=1", "mesh.fsdp=2"])
    assert (at_step_3.train.seq_len, at_step_3.model.rope_theta, at_step_3.mesh.ring) == (64, 20000.0, 1)
    assert config_at_step(config, 1, []).train.seq_len == 32 and not config_at_step(config, 1, []).stages
    held_out = tmp_path / "held_out.npy"
    np.save(held_out, (np.arange(4000) * 7 % 128).astype(np.int32))
    result = run_cli("eval", tmp / "run" / "config.yaml", f"eval.path={held_out}", "eval.passkey_trials=0",
                     "--checkpoint", tmp / "ckpt", "--json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["step"] == 4 and printed["seq_len"] == 64


def test_the_dry_run_shows_every_stage(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    result = run_cli("train", config, *SMALL_MODEL, "mesh.fsdp=2", "mesh.sp=4", "train.steps=4", STAGES, "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "stage 1 of 2: steps 1-2 at seq_len 32" in result.stdout
    assert "stage 2 of 2: steps 3-4 at seq_len 64" in result.stdout
    assert result.stdout.count("device total") == 2


@needs_gpu_compiler
def test_on_a_gpu_each_stage_has_an_estimated_step_time_and_the_recipe_its_total():
    """What `--dry-run` prints on a node of H100s, compiled here for compile-only ones."""
    config = load_config(None, [*WHOLE_STACK, "train.steps=4", "stages=[{until_step: 2, set: {train.seq_len: 2048}}, "
                                "{until_step: 4, set: {train.seq_len: 4096}}]"])
    lines = stage_plans(stage_runs(config), H100, gpu_devices("h100", 8))
    estimates = [line for line in lines if line.startswith("estimated step time")]
    assert len(estimates) == 2 and all("an estimate, not a measurement" in line for line in estimates)
    times = [float(line.split()[3].replace(",", "")) for line in estimates]
    recipe = [line for line in lines if line.startswith("the whole recipe: estimated ")]
    assert recipe == [f"the whole recipe: estimated {2 * sum(times) / 3600:,.1f} h"]
