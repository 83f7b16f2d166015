"""jlong from Python (`jlong.plan`, `jlong.maxlen`, `jlong.train`,
`jlong.evaluate`): the same numbers as the command line, in a process that
imported jax first, with the library's one-line errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, SMALL_LONG, SMALL_MODEL, needs_gpu_compiler, run_cli, small_long

import jlong
from jlong.planner.maxlen import best_length
from jlong.planner.memory import GIB, plan as memory_plan


def test_plan_is_the_function_whatever_was_imported_and_matches_the_command_line(tmp_path):
    import jlong.planner.memory  # noqa: F401  (the packages below jlong never take its names)
    import jlong.training.loop  # noqa: F401

    assert callable(jlong.plan) and callable(jlong.train) and callable(jlong.evaluate)
    first = jlong.plan(small_long(), target="cpu")
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    again = jlong.plan(config, SMALL_LONG, target="cpu")
    printed = json.loads(run_cli("plan", config, *SMALL_LONG, "--json", "--target", "cpu").stdout)
    assert first.device_bytes == again.device_bytes == printed["device_total"]
    assert first.host_bytes_per_node == printed["host_per_node"] and first.fits is printed["fits"] is True
    assert first.step_time_s is None and printed["step_time_s"] is None  # no step cost on the cpu target
    assert first.as_dict() == printed


@pytest.mark.slow  # a second maxlen search; CI runs test_planner's
def test_maxlen_reports_every_setting_and_a_refused_one():
    base = small_long("memory.mlp_tile=1024", "memory.loss_tile=1024", "train.seq_len=8192")
    budget = memory_plan(small_long("memory.mlp_tile=1024", "memory.loss_tile=1024",
                                    "train.seq_len=16384")).device_total / GIB * (1 + 1e-6)
    heard = []
    results = jlong.maxlen(base, target="cpu", budget_gib=budget, search=["attention.heads_per_stage=8,3"],
                           on_probe=lambda seq_len, plan: heard.append((seq_len, plan.fits)))
    assert [r.setting for r in results] == [["attention.heads_per_stage=8"], ["attention.heads_per_stage=3"]]
    assert results[0].found.seq_len == 16384 and results[0].found.bound_by == "device"
    assert heard == [(seq_len, plan.fits) for seq_len, plan in results[0].found.probes] and len(heard) >= 2
    assert results[1].found is None and "must be a multiple of mesh.sp" in str(results[1].refusal)
    assert best_length(results) is results[0]


def test_train_then_evaluate_from_python(tmp_path):
    overrides = [*SMALL_MODEL, "mesh.fsdp=2", "mesh.sp=4", "train.steps=3", "train.lr=1e-2",
                 f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    config = jlong.load_config(None, overrides)
    records = jlong.train(config)
    assert [r["step"] for r in records] == [1, 2, 3]
    held_out = tmp_path / "held_out.npy"
    np.save(held_out, (np.arange(2000) * 7 % 128).astype(np.int32))
    result = jlong.evaluate(config, tmp_path / "ckpt", [f"eval.path={held_out}", "eval.passkey_trials=0"])
    assert result["step"] == 3 and result["loss"] > 0 and result["passkey"] == []


def _fresh_python(code: str, devices: int | None = None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=REPO)


def test_a_process_where_jax_started_with_too_few_devices_gets_one_clear_error():
    code = ("import jax, jlong\n"
            "jax.numpy.zeros(1)\n"
            "try:\n"
            "    jlong.plan('configs/tiny.yaml', ['data.source=synthetic', 'data.path=null'], target='cpu')\n"
            "except jlong.JlongError as err:\n"
            "    print(err)\n")
    done = _fresh_python(code, devices=1)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("jax started with 1 CPU device(s) before jlong could give it the 8 this mesh "
                                  "needs: call jax.config.update('jax_num_cpu_devices', 8) right after 'import jax'")


@needs_gpu_compiler
def test_plan_on_h100_in_a_fresh_process_that_imported_jax_first_prints_the_command_lines_bytes(tmp_path):
    overrides = [*SMALL_LONG, "mesh.fsdp=1", "train.seq_len=16384"]
    code = (f"import jax, jlong; print(jlong.plan('configs/tiny.yaml', {overrides!r}, "
            "target='h100').device_bytes)")
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = run_cli("plan", REPO / "configs/tiny.yaml", *overrides, "--target", "h100", "--json")
    assert int(done.stdout.strip()) == json.loads(printed.stdout)["device_total"]


@pytest.mark.fast
def test_a_config_that_is_neither_is_refused():
    with pytest.raises(jlong.JlongError, match="a config is a jlong.Config or the path of a YAML file, got int"):
        jlong.plan(42)


@pytest.mark.fast
def test_argument_errors_name_the_argument_in_python_and_the_flag_on_the_command_line(tmp_path):
    with pytest.raises(jlong.JlongError, match=r"^unknown target 'h300' \(did you mean") as python:
        jlong.plan(small_long(), target="h300")
    assert python.value.for_command_line().startswith("unknown --target 'h300'")
    config = tmp_path / "small.yaml"
    config.write_text("{}\n")
    printed = run_cli("plan", config, *SMALL_LONG, "--target", "h300")
    assert printed.stderr.strip().startswith("jlong: error: unknown --target 'h300'")
