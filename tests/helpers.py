"""What several test modules share: small configs, the single-device reference
computation, training runs, and the command line run in-process."""

import contextlib
import importlib.util
import io
import json
import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import yaml

import pytest

from jlong.config import config_to_dict, load_config
from jlong.data.sources import Batches
from jlong.parallel.placement import make_mesh
from jlong.planner.targets import (
    MIN_CUDNN_FOR_DEVICELESS_ATTENTION,
    PlanTarget,
    cuda_plugin_installed,
    installed_cudnn_version,
)
from jlong.program.train_program import TrainProgram

REPO = Path(__file__).resolve().parents[1]

SMALL_MODEL = [
    "model.vocab_size=128", "model.hidden_size=64", "model.intermediate_size=128",
    "model.num_hidden_layers=2", "model.num_attention_heads=8", "model.num_key_value_heads=4",
    "train.seq_len=64", "train.batch_size=8", "train.compute_dtype=float32", "attention.block_size=16",
    "data.source=synthetic",
]
MESH = ["mesh.fsdp=2", "mesh.sp=4"]

# Llama-shaped and small, on sp=8 with the whole memory stack: for plans.
SMALL_LONG = [
    "model.vocab_size=512", "model.hidden_size=128", "model.intermediate_size=384", "model.num_hidden_layers=2",
    "model.num_attention_heads=8", "model.num_key_value_heads=8", "mesh.sp=8", "train.batch_size=1",
    "train.seq_len=8192", "attention.impl=blockwise", "attention.block_size=256",
    "memory.remat=offload_inputs", "memory.mlp_tile=128", "memory.loss_tile=128",
]


def small_config(*overrides):
    return load_config(None, [*SMALL_MODEL, *overrides])


def small_long(*overrides):
    return load_config(None, [*SMALL_LONG, *overrides])


def loss_and_grads(config, devices, adjust=None):
    """Loss and gradients of step 1's batch from seed-0 parameters (changed by `adjust(params)` first, if
    given), as numpy."""
    program = TrainProgram(config, make_mesh(config.mesh, devices))
    params = program.init_params(seed=0)
    if adjust:
        params = adjust(params)
    batch = program.place_batch(Batches.from_config(config).batch(1))
    loss, grads = jax.jit(jax.value_and_grad(program.loss))(params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


def leaf_at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def assert_same_result(got, want):
    """(loss, grads) pairs equal to float32 rounding: a gradient entry within 1e-5 of itself, or of its
    leaf's largest entry (an entry summed from terms that large, in another order, cancelling)."""
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        want_leaf = leaf_at(want_grads, path)
        np.testing.assert_allclose(leaf, want_leaf, rtol=1e-5, atol=max(1e-7, 1e-5 * float(np.abs(want_leaf).max())),
                                   err_msg=jax.tree_util.keystr(path))


def run_config(tmp_path, *overrides):
    """A short learning run on fsdp=2 x sp=4 with its run and checkpoint directories."""
    return load_config(None, [
        *SMALL_MODEL, *MESH, "train.steps=6", "train.warmup_steps=2", "train.lr=1e-2",
        f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides,
    ])


def logged_losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


def handles(pid: int, signum: int) -> bool:
    """Whether the process has installed a handler for `signum` (Linux: the SigCgt mask of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signum - 1) & 1)


def assert_stopped_with_a_checkpoint(out: str, signal_name: str, run_dir: Path, checkpoints: Path) -> None:
    """The run's last line says it stopped on `signal_name` (before its first
    step, or after a step whose checkpoint is the newest, as the metrics say)."""
    from jlong.checkpoint import Checkpoints

    line = out.strip().splitlines()[-1]
    if line == f"stopped on {signal_name} before the first step; nothing to save":
        assert not checkpoints.exists() or not any(p.name.isdigit() for p in checkpoints.iterdir())
        return
    stopped_at = int(line.removeprefix("stopped at step ").split(" ")[0])
    assert line == f"stopped at step {stopped_at} on {signal_name}; checkpoint saved in {checkpoints} " \
        "(the same command resumes)"
    saved = Checkpoints(checkpoints)
    assert saved.latest_step() == stopped_at == steps_logged(run_dir)
    saved.close()


def wait_for_steps(process, run_dir: Path, steps: int, delay: float, signum: int) -> None:
    """Returns `delay` seconds after `steps` steps are logged and the process handles `signum`."""
    deadline = time.monotonic() + 300
    while steps_logged(run_dir) < steps or not handles(process.pid, signum):
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its signal"
        time.sleep(0.005)
    time.sleep(delay)


def train_command(tmp_path, config, *flags):
    """`jlong train` in a subprocess on `config` written to a file, and its
    environment (the CLI gives the CPU as many devices as the mesh needs)."""
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(config)))
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    return [sys.executable, "-m", "jlong", "train", str(config_file), *flags], env


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def run_cli(*args) -> CliResult:
    """`jlong ARGS` in this process (its 8 CPU devices), with what it prints
    and the environment variables it sets undone afterwards."""
    from jlong.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    environ = dict(os.environ)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main([str(a) for a in args])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return CliResult(code, stdout.getvalue(), stderr.getvalue())


def assert_one_line_error(result: CliResult, message: str):
    """Exit status 2 and a single `jlong: error:` line that holds `message`."""
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jlong: error: "), result.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr

# The GPU compiler's tests: XLA:GPU for compile-only H100s, where the plugin is installed.
_cudnn = installed_cudnn_version() if cuda_plugin_installed() else None
needs_gpu_compiler = pytest.mark.skipif(
    _cudnn is None or _cudnn < MIN_CUDNN_FOR_DEVICELESS_ATTENTION,
    reason="SKIPPED GPU-COMPILER TEST: the CUDA plugin with cuDNN >= 9.8 is not installed "
    "(pip install -e '.[gpu-plan]'); XLA:GPU was not checked",
)
H100 = PlanTarget("h100")

# Llama-shaped and small, with the whole stack on fsdp=2 x sp=4: UPipe stages
# of U = sp = 4 of 8 heads in shard_map, attention by `auto` (cuDNN on a GPU),
# layer inputs offloaded to host, tiled MLP and loss.
WHOLE_STACK = [
    "model.vocab_size=512", "model.hidden_size=256", "model.intermediate_size=512", "model.num_hidden_layers=2",
    "model.num_attention_heads=8", "model.num_key_value_heads=2", "model.head_dim=64",
    "mesh.fsdp=2", "mesh.sp=4", "attention.heads_per_stage=4", "attention.impl=auto",
    "memory.remat=offload_inputs", "memory.mlp_tile=256", "memory.loss_tile=256",
    "train.seq_len=4096", "train.batch_size=2", "train.compute_dtype=bfloat16", "train.param_dtype=float32",
]


def whole_stack(*overrides):
    return load_config(None, [*WHOLE_STACK, *overrides])


_COMPILED_STEPS = {}


def compiled_step(config, target=H100):
    """`compile_train_step(config, target)`, compiled once per test process for equal configs (the tests
    that share one read its program and plan, never change them)."""
    from jlong.planner.memory import compile_train_step

    key = (config.model_dump_json(), repr(target))
    if key not in _COMPILED_STEPS:
        _COMPILED_STEPS[key] = compile_train_step(config, target)
    return _COMPILED_STEPS[key]


def load_experiment(name: str):
    """experiments/NAME.py as a module, loaded from its file: the experiments
    are scripts, not on the import path (their names would read as modules')."""
    module_name = f"experiments.{name}"
    if str(REPO / "experiments") not in sys.path:  # the scripts import their shared `common` module
        sys.path.append(str(REPO / "experiments"))
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "experiments" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def tensorboard_scalars(directory):
    """(tag, step, value) of every scalar in the TensorBoard event files (TFRecord framing, Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    found = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return found


def interpreted(f):
    """f (which runs Mosaic GPU kernels in their interpreter) as one program, waited for before anything else
    is dispatched. The interpreter's host callbacks run jax computations of their own, and jax 0.10's CPU
    client makes them wait for any computation dispatched after the kernel's: about 30 of those (an eager
    loss around the kernel is enough) leave no room for them, and the test hangs."""
    return lambda *args: jax.block_until_ready(jax.jit(f)(*args))
