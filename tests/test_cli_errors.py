"""Bad input on the command line: exit status 2, one line, no traceback, and
an existing run directory left byte-for-byte as it was. The cases run the
CLI in-process; two smoke tests run the real `python -m jlong`."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_one_line_error, run_cli
from hf_models import small_hf_model

GOOD = "model:\n  preset: llama3.2-1b\n  num_hidden_layers: 1\nrun_dir: {run}\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs the cases share: checkpoints, token files, malformed YAML."""
    tmp = tmp_path_factory.mktemp("inputs")
    hf_dir = tmp / "hf"
    small_hf_model("llama").save_pretrained(hf_dir)
    bad_hf = tmp / "bad_hf"
    small_hf_model("llama").save_pretrained(bad_hf)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    (bad_hf / "config.json").write_text(json.dumps({**hf_config, "hidden_size": 32}))
    np.save(tmp / "tokens2d.npy", np.zeros((4, 4), np.int32))
    np.save(tmp / "short.npy", np.zeros(10, np.int32))
    np.save(tmp / "floats.npy", np.zeros(5000, np.float32))
    np.save(tmp / "big_ids.npy", np.full(5000, 999_999, np.int64))
    (tmp / "malformed.yaml").write_text("model: [\n")
    (tmp / "random.npy").write_bytes(np.random.default_rng(0).bytes(5000))
    (tmp / "empty").mkdir()
    return tmp


@pytest.fixture
def workspace(tmp_path, files):
    """A run directory from an earlier run, and a config that points at it."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {hidden_size: 1}\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    (tmp_path / "good.yaml").write_text(GOOD.format(run=run))
    return tmp_path


CASES = {
    "unknown key": (["train", "{cfg}", "train.setps=3"], "did you mean 'train.steps'"),
    "malformed yaml": (["train", "{files}/malformed.yaml"], "cannot parse"),
    "missing config": (["train", "{files}/nope.yaml"], "does not exist"),
    "kv heads": (["train", "{cfg}", "model.num_key_value_heads=3"], "multiple of model.num_key_value_heads"),
    "missing hf files": (["train", "{cfg}", "model.hf_path={files}/empty"], "has no config.json"),
    "hf contradicts inline": (["train", "{cfg}", "model.hf_path={files}/hf", "model.preset=null"],
                              "model.num_hidden_layers=1 contradicts the checkpoint"),
    "hf shape mismatch": (["convert", "{files}/bad_hf", "{tmp}/out"], "has shape"),
    "token file missing": (["train", "{cfg}", "data.source=tokens", "data.path={files}/none.npy"], "does not exist"),
    "token file 2-D": (["train", "{cfg}", "data.source=tokens", "data.path={files}/tokens2d.npy"], "1-D integer"),
    "token file short": (["train", "{cfg}", "data.source=tokens", "data.path={files}/short.npy"], "fewer than one sample"),
    "different run": (["train", "{cfg}", "train.steps=1", "train.seq_len=64", "train.batch_size=1"], "belongs to a different configuration"),
    "bad flag": (["train", "{cfg}", "--frobnicate"], "unrecognized arguments: --frobnicate (see 'jlong train --help')"),
    "stray argument after a flag": (["plan", "{cfg}", "--json", "extra"], "unrecognized arguments: extra"),
    "wrong type": (["train", "{cfg}", "train.steps=many"], "train.steps must be an integer"),
    "zero count": (["train", "{cfg}", "train.batch_size=0"], "train.batch_size must be positive"),
    "negative lr": (["train", "{cfg}", "train.lr=-1e-3"], "train.lr must be positive"),
    "seq_len vs sp": (["train", "{cfg}", "mesh.sp=8", "train.seq_len=1001"], "nearest valid: 1000 or 1008"),
    "heads vs sp": (["train", "{cfg}", "mesh.sp=8", "attention.heads_per_stage=12"], "values that work: 8, 16, 32"),
    "sp splits no heads, whatever the length": (["train", "{cfg}", "mesh.sp=7", "train.seq_len=1000"],
                                                "not divisible by mesh.sp (7)"),
    "efficiency": (["plan", "{cfg}", "--efficiency", "attention_fwd=1.5"], "--efficiency attention_fwd must be in"),
    "fastest without settings": (["maxlen", "{cfg}", "--fastest"], "--fastest ranks the settings of --search"),
    "tile": (["train", "{cfg}", "mesh.sp=8", "train.seq_len=2048", "memory.loss_tile=100"], "nearest that work: 64, 128"),
    "token ids": (["train", "{cfg}", "data.source=tokens", "data.path={files}/big_ids.npy"], "outside the model's vocabulary"),
    "random bytes as tokens": (["train", "{cfg}", "data.source=tokens", "data.path={files}/random.npy"],
                               "is not a token file"),
    "a hybrid model without one of its layer types": (["train", "configs/tiny.yaml", "model.preset=tiny-qwen3.5",
                                                       "model.num_hidden_layers=2", "run_dir={tmp}/run"],
                                                      "model.num_hidden_layers=2 gives model.family=qwen3_5_text no "
                                                      "full_attention layer"),
    "float tokens": (["train", "{cfg}", "data.source=tokens", "data.path={files}/floats.npy"], "1-D integer"),
    "budget below states": (["maxlen", "{cfg}", "--budget-gib", "0.5"], "below the"),
    "zero budget": (["plan", "{cfg}", "--budget-gib", "0"], "--budget-gib must be positive"),
    "devices": (["plan", "{cfg}", "--devices", "3"], "--devices 3, but the mesh"),
    "bad command": (["fly"], "invalid choice"),
    "eval without a checkpoint": (["eval", "{cfg}", "eval.passkey_trials=0", "--checkpoint", "{files}/none"],
                                  "/none' is not a directory"),
    "passkey digits": (["eval", "{cfg}", "eval.passkey_digits=12", "--checkpoint", "{files}/hf"],
                       "eval.passkey_digits must be 1 to 9, got 12"),
    "eval of an empty directory": (["eval", "{cfg}", "--checkpoint", "{files}/empty"], "holds no jlong checkpoint"),
    "eval_every without eval.path": (["train", "{cfg}", "train.eval_every=5"], "set eval.path"),
    "log_to without run_dir": (["train", "{cfg}", "run_dir=null", "train.log_to=[tensorboard]"], "set run_dir"),
    "log_to a sink that is not one": (["train", "{cfg}", "train.log_to=[tensorbord]"], "did you mean 'tensorboard'"),
    "documents without an end id": (["train", "{cfg}", "data.source=tokens", "data.path={files}/short.npy",
                                     "data.sampling=documents"], "records no end-of-document id: set data.eos_id"),
    "until-step 0": (["train", "{cfg}", "--until-step", "0"], "--until-step must be a step of the run (1 to"),
    "until-step -1 in a dry run": (["train", "{cfg}", "--until-step", "-1", "--dry-run"],
                                   "--until-step must be a step of the run"),
    "end id outside the vocabulary": (["train", "{cfg}", "data.eos_id=300000"],
                                      "data.eos_id (300000) is outside the model's vocabulary (ids 0-128255)"),
    "eval.path missing, train": (["train", "{cfg}", "train.eval_every=5", "eval.path={files}/none.npy"],
                                 "eval.path '{files}/none.npy' does not exist"),
    "eval.path missing, eval": (["eval", "{cfg}", "eval.path={files}/none.npy", "--checkpoint", "{files}/hf"],
                                "eval.path '{files}/none.npy' does not exist"),
    "config is a directory": (["train", "{files}/empty"], "is a directory; give the YAML file in it"),
    "convert over files": (["convert", "{files}/hf", "{files}"], "is not an empty directory"),
    "lora target that is not a layer": (["plan", "{cfg}", "lora.targets=[q_proj,qkv]"],
                                        "lora.targets 'qkv' is not a linear layer of model.family=llama: choose from"),
    "lora on a mixture's experts": (["plan", "configs/tiny.yaml", "model.preset=tiny-qwen3-moe",
                                     "lora.targets=[q_proj,gate_up_proj]"], "the experts of a mixture are not adapted"),
    "lora with the optimizer offloaded": (["train", "{cfg}", "lora.rank=8", "memory.optimizer_offload=true"],
                                          "a LoRA run trains only its adapters"),
    "lora base dtype": (["train", "{cfg}", "lora.base_dtype=int4"], "lora.base_dtype must be one of compute, nf4"),
    "lora beside train.init_from": (["train", "{cfg}", "lora.rank=8", "train.init_from={files}/hf"],
                                    "its adapters start from lora.init_from"),
    "negative max tokens": (["prepare", "{tmp}/new/t.npy", "{files}/empty", "--max-tokens", "-5"],
                            "--max-tokens must be positive, got -5"),
    "zero max tokens": (["prepare", "{tmp}/new/t.npy", "{files}/empty", "--max-tokens", "0"],
                        "--max-tokens must be positive"),
}


@pytest.mark.fast
@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_one_line(name, workspace, files):
    args, message = CASES[name]
    args = [a.format(cfg=workspace / "good.yaml", tmp=workspace, files=files) for a in args]
    before = {p.name: p.read_bytes() for p in (workspace / "run").iterdir()}
    inputs = sorted(files.rglob("*"))
    assert_one_line_error(run_cli(*args), message.format(files=files))
    assert {p.name: p.read_bytes() for p in (workspace / "run").iterdir()} == before
    assert sorted(p.name for p in workspace.iterdir()) == ["good.yaml", "run"]  # nothing new written
    assert sorted(files.rglob("*")) == inputs


@pytest.mark.fast
def test_a_missing_metrics_package_is_refused_before_anything_is_built_or_written(tmp_path, monkeypatch):
    """train.log_to naming W&B without wandb installed: one line before compiling, no run or checkpoint dir."""
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    (tmp_path / "good.yaml").write_text(GOOD.format(run=tmp_path / "run"))
    result = run_cli("train", tmp_path / "good.yaml", "train.log_to=[jsonl,wandb]", f"checkpoint.dir={tmp_path / 'ck'}")
    assert_one_line_error(result, "train.log_to names wandb, which is not installed: pip install 'jlong[wandb]'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.yaml"]


def _real_cli(*args, devices: int | None = None):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if devices:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", "jlong", *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_real_command_line_reports_a_bad_key_in_one_line(workspace):
    assert_one_line_error(_real_cli("train", workspace / "good.yaml", "train.setps=3"), "did you mean 'train.steps'")


def test_real_command_line_refuses_a_mesh_that_does_not_match_the_devices(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model: {preset: llama3.2-1b, num_hidden_layers: 1}\nmesh: {fsdp: 2, sp: 2}\n")
    result = _real_cli("train", config, devices=8)
    assert_one_line_error(result, "= 4, but 8 devices are visible; make the product 8")
