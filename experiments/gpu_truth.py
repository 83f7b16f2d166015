"""What jlong promises against what one GPU does, in one command.

    python experiments/gpu_truth.py [--out experiments/results]     # one GPU: about 5 minutes on an H100
    python experiments/gpu_truth.py --rehearse --out DIR            # the same pipeline on 8 virtual CPU devices

Writes gpu-truth.json and gpu-truth.md into --out:

- cuDNN: every path `experiments/gpu_check.py` checks (causal, packed, ring
  off-diagonal, sliding window, backward given an external output and
  log-sum-exp, attention sinks), each output's worst error against the
  float32 blockwise kernel beside blockwise bf16's own;
- Qwen3.5's kernels (`experiments/gpu_kernels.py`): the Triton grouped
  matmul of routed experts and the chunked gated delta rule, every output
  against a float32 reference beside a bf16 yardstick;
- training cases on one device (`configs/llama3.2-1b-one-gpu.yaml` with
  three models: Llama 3.2 1B, Qwen3.5-0.8B's hybrid, and Qwen3.5-35B-A3B cut
  to four layers of 128 experts; each under two memory settings): each a
  `jlong train` of a few steps in its own process, its median step time
  after warm-up and the device's peak bytes (`peak_bytes_in_use`), beside
  `jlong.plan` of the same config for this GPU (planned bytes, estimated
  step time: the estimate is read from the compiled program, the time is
  measured);
- the rates behind the planner's assumptions: a bf16 GEMM, cuDNN causal
  attention forward and backward at a long length (FLOPs counted as the
  planner counts them), an elementwise kernel's device-memory traffic,
  copies between the device and pinned host memory, the Triton grouped
  matmul (and XLA's ragged_dot beside it), each beside the rate `jlong
  plan` assumes (data-sheet peak x its default efficiency); and the chunked
  gated delta rule's tokens/s beside the planner's estimate of that same
  program;
- `jlong train` as a user runs it (a small model on the learnable synthetic
  data): the loss finite and falling, `peak_bytes` in metrics.jsonl.

Every GPU part runs in a child process, so each training case measures its
own peak; plans compile on the CPU beside them. The rehearsal runs all of it
with tiny shapes and the cpu target (the training cases on the tiny model
alone, the Triton kernels interpreted, cuDNN checks listed as not run, rates
measured on the CPU beside the same assumed values): that is how the suite
keeps this script from rotting. Without a GPU and without --rehearse it
exits 2 with one line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jlong.jax_startup import import_jax_quietly, start_backends

import_jax_quietly()  # before anything imports jax: no CUDA plugin's "no driver" lines on a CPU machine

from common import GIB, ROOT, commit, machine, markdown_table, median_seconds, portable  # noqa: E402 (imports jax)

HERE = Path(__file__).resolve()
TRAIN_STEPS = 5  # the first two are warm-up (compilation, first touches); the median of the rest is the step time
WARMUP_STEPS = 2


# The training cases' models, each on the one-GPU config with its lengths and memory settings: the dense
# model the stack was built on, the Qwen3.5 hybrid (Gated DeltaNet and gated attention), and a Qwen3.5-MoE cut
# to one period of layers and half its experts so that it fits one GPU with its optimizer state.
BOTH = ("save_attention", "offload_inputs")
GPU_MODELS = {
    "qwen3.5-0.8b": (["model.preset=qwen3.5-0.8b"], [8192], BOTH),
    "qwen3.5-35b-a3b 4 layers 128 experts": (["model.preset=qwen3.5-35b-a3b", "model.num_hidden_layers=4",
                                              "model.num_experts=128"], [8192], BOTH),
    "llama3.2-1b": ([], [16384], BOTH),
}
REHEARSAL_MODELS = {"tiny": ([], [128], BOTH)}  # the pipeline is the same for every model and length


class Setup:
    """What one run of the script measures: the GPU's shapes, or the rehearsal's tiny ones."""

    def __init__(self, rehearse: bool, seq_lens: list[int] | None, memory: list[str]):
        self.rehearse = rehearse
        if rehearse:
            self.config = str(ROOT / "configs" / "tiny.yaml")
            self.base = ["mesh.fsdp=1", "mesh.sp=1", "data.source=synthetic", "data.eos_id=null",
                         "attention.block_size=128"]
            self.models = REHEARSAL_MODELS
            self.user_run = [str(ROOT / "configs" / "tiny.yaml"), "data.source=synthetic", "data.eos_id=null",
                             "train.steps=12", "train.warmup_steps=2", "train.seq_len=128"]
            self.kernel_args = ["--gemm", "256", "--attention-len", "1024", "--heads", "4", "--kv-heads", "2",
                                "--head-dim", "32", "--copy-mib", "16", "--experts", "512", "64", "32", "8",
                                "--linear-len", "512"]
        else:
            self.config = str(ROOT / "configs" / "llama3.2-1b-one-gpu.yaml")
            self.base = []
            self.models = GPU_MODELS
            self.user_run = [str(ROOT / "configs" / "tiny.yaml"), "mesh.fsdp=1", "mesh.sp=1", "data.source=synthetic",
                             "data.eos_id=null", "train.steps=30", "train.warmup_steps=3"]
            # experts: 8,192 tokens routed to 8 of 128 experts of Qwen3.5-35B-A3B's shape (2,048 -> 512)
            self.kernel_args = ["--gemm", "8192", "--attention-len", "32768", "--heads", "32", "--kv-heads", "8",
                                "--head-dim", "128", "--copy-mib", "1024", "--experts", "65536", "2048", "512", "128",
                                "--linear-len", "32768"]
        self.seq_lens = seq_lens
        self.memory = memory

    def cases(self) -> list[dict]:
        """The models' cases, each length under each memory setting (--seq-lens, --memory: these for every model)."""
        return [{"name": f"{model} {seq_len:,} {memory}", "model": model, "seq_len": seq_len, "memory": memory,
                 "overrides": [*self.base, *overrides, f"train.seq_len={seq_len}", f"memory.remat={memory}"]}
                for model, (overrides, lengths, memories) in self.models.items()
                for seq_len in self.seq_lens or lengths for memory in self.memory or memories]

    def env(self) -> dict:
        """Every child's environment: jlong from this checkout, no preallocated pool (a run's
        peak is what it used), and on the rehearsal the CPU alone."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
        if self.rehearse:  # jlong gives each run the virtual CPU devices its mesh needs
            env["JAX_PLATFORMS"] = "cpu"
            flags = env.get("XLA_FLAGS", "").split()
            env["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))
        return env


# --------------------------------------------------------------------------
# The orchestrating process: never computes on the GPU itself


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on 8 virtual CPU devices, cpu target")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results",
                        help="where gpu-truth.json and gpu-truth.md go (default experiments/results)")
    parser.add_argument("--seq-lens", type=int, nargs="+", help="lengths of the training cases")
    parser.add_argument("--memory", nargs="+", help="memory.remat of the training cases (default: each model's)")
    parser.add_argument("--deadline-s", type=float, default=330.0,
                        help="training cases not started by then are listed as skipped (a GPU lent for minutes)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    setup = Setup(args.rehearse, args.seq_lens, args.memory)
    target = "cpu"
    if not args.rehearse:
        target = gpu_target()
        if target is None:
            return 2
    work = Path(tempfile.mkdtemp(prefix="jlong-gpu-truth-"))
    report = Report(args.out, command=" ".join(["python", "experiments/gpu_truth.py",
                                                *map(portable, argv if argv is not None else sys.argv[1:])]),
                    rehearse=args.rehearse, target=target)
    cases = setup.cases()
    with concurrent.futures.ThreadPoolExecutor(1) as planning:
        plans = planning.submit(child, setup, work / "plans.json", "plans", "--target", target,
                                "--config", setup.config, "--cases", json.dumps(cases))
        note(started, "rates")
        report.rates(child(setup, work / "rates.json", "rates", "--target", target, *setup.kernel_args))
        if not args.rehearse:
            note(started, "cuDNN checks")
            report.checks("cudnn", child(setup, work / "cudnn.json", "cudnn", "--check-len", "4096"))
        note(started, "Qwen3.5's kernels")
        small = ["--small"] if args.rehearse else []
        report.checks("kernels", child(setup, work / "kernels.json", "kernels", *small))
        note(started, "jlong train as a user runs it")
        report.user_run(train_run(setup, setup.user_run, work / "user-run"))
        measured = []
        for case in cases:
            if time.monotonic() - started > args.deadline_s:
                measured.append({**case, "skipped": f"past the {args.deadline_s:g} s deadline"})
                continue
            note(started, f"case {case['name']}")
            run_dir = work / f"case-{len(measured)}"
            measured.append({**case, **train_run(setup, [setup.config, *case["overrides"]], run_dir)})
            report.cases(measured, {})
        note(started, "waiting for the plans")
        report.cases(measured, plans.result())
    report.finish(time.monotonic() - started)
    shutil.rmtree(work, ignore_errors=True)
    print(report.markdown())
    print(f"wrote {args.out / 'gpu-truth.md'} and gpu-truth.json ({time.monotonic() - started:.0f} s)")
    return 0


def note(started: float, text: str) -> None:
    print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)


def gpu_target() -> str | None:
    """The planner's name for this machine's GPU; None (and one line) where jax sees no GPU."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # this process computes nothing there
    start_backends()
    import jax

    from jlong.planner.targets import known_gpu

    device = jax.devices()[0]
    if device.platform != "gpu":
        print(f"gpu_truth needs a GPU and this machine's jax sees {device.platform} devices only; "
              "--rehearse runs the same pipeline on the CPU", file=sys.stderr)
        return None
    name = known_gpu(device)
    if name is None:
        print(f"jlong plans for h100, h200 and b200, not {device.device_kind}", file=sys.stderr)
    return name


def child(setup: Setup, out: Path, part: str, *args: str) -> dict:
    """One part in a process of its own; its JSON, or what went wrong."""
    command = [sys.executable, str(HERE), "--child", part, "--child-out", str(out), *args]
    result = subprocess.run(command, env=setup.env(), capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0 or not out.is_file():
        return {"failed": f"exit {result.returncode}: {tail(result.stderr)}"}
    return json.loads(out.read_text())


def train_run(setup: Setup, arguments: list[str], run_dir: Path) -> dict:
    """`jlong train` of TRAIN_STEPS steps (unless the arguments say otherwise) in its own process."""
    command = [sys.executable, "-m", "jlong", "train", *arguments, f"run_dir={run_dir}", "checkpoint.dir=null"]
    if not any(a.startswith("train.steps=") for a in arguments):
        command.append(f"train.steps={TRAIN_STEPS}")
    began = time.monotonic()
    result = subprocess.run(command, env=setup.env(), capture_output=True, text=True, cwd=ROOT)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    outcome = {"wall_s": round(time.monotonic() - began, 1), "losses": [r["loss"] for r in records],
               "step_times_s": [r["step_time_s"] for r in records],
               "measured_peak_bytes": max((r.get("peak_bytes") or 0 for r in records), default=0) or None}
    timed = outcome["step_times_s"][WARMUP_STEPS:]
    outcome["measured_step_s"] = statistics.median(timed) if timed else None
    if result.returncode != 0:
        outcome["failed"] = f"exit {result.returncode}: {tail(result.stderr)}"
    return outcome


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())[-1200:]


# --------------------------------------------------------------------------
# The child processes


def child_main(part: str, out: Path, argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    if part == "plans":
        parser.add_argument("--target", required=True)
        parser.add_argument("--config", required=True)
        parser.add_argument("--cases", required=True)
    elif part == "rates":
        parser.add_argument("--target", required=True)
        for flag in ("--gemm", "--attention-len", "--heads", "--kv-heads", "--head-dim", "--copy-mib", "--linear-len"):
            parser.add_argument(flag, type=int, required=True)
        parser.add_argument("--experts", type=int, nargs=4, required=True, metavar=("ROWS", "K", "N", "GROUPS"))
    elif part == "kernels":
        parser.add_argument("--small", action="store_true")
    else:
        parser.add_argument("--check-len", type=int, required=True)
    args = parser.parse_args(argv)
    if part != "plans":
        start_backends()
    result = {"plans": plan_cases, "rates": measure_rates, "cudnn": cudnn_checks, "kernels": kernel_checks}[part](args)
    out.write_text(json.dumps(result, indent=1))
    return 0


def plan_cases(args) -> dict:
    """`jlong.plan` of every case for the target: planned bytes, estimated step time (name -> dict)."""
    import jlong

    plans = {}
    for case in json.loads(args.cases):
        try:
            plan = jlong.plan(args.config, case["overrides"], target=args.target)
            plans[case["name"]] = {"planned_bytes": plan.device_bytes, "estimated_step_s": plan.step_time_s,
                                   "planned_host_bytes": plan.memory.host_offload}
        except Exception as error:  # the case is reported as not planned, the others go on
            plans[case["name"]] = {"plan_failed": str(error).splitlines()[0][:300]}
    return plans


def measure_rates(args) -> dict:
    import jax

    on_gpu = jax.devices()[0].platform == "gpu"
    return {"device": describe_device(), "versions": versions(on_gpu), "rates": rates(args, on_gpu)}


def describe_device() -> dict:
    import jax

    device = jax.devices()[0]
    description = {"platform": device.platform, "kind": device.device_kind, "count": len(jax.devices())}
    if device.platform == "cpu":
        description["machine"] = machine()
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        description["memory_limit_bytes"] = int(stats["bytes_limit"])
    return description


def versions(on_gpu: bool) -> dict:
    import jax
    import jaxlib

    found = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__}
    if on_gpu:
        from jlong.planner.targets import installed_cudnn_version

        cudnn = installed_cudnn_version()
        found["cudnn"] = ".".join(map(str, cudnn)) if cudnn else None
        found["platform_version"] = getattr(jax.devices()[0].client, "platform_version", None)
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
            found["driver"] = smi.split(",")[0].strip()
        except (OSError, IndexError, subprocess.SubprocessError):
            found["driver"] = None
    return found


CUDNN_PATHS = ("causal", "packed", "off-diagonal", "off-diagonal packed", "sliding window", "sliding window packed",
               "sinks sliding window packed")


def cudnn_checks(args) -> dict:
    """gpu_check's paths: 32 query heads over 8 kv heads of 128, 12 packed documents, a window of 1,024."""
    from gpu_check import check_all

    rows = check_all(args.check_len, 32, 8, 128, 12, 1024, print_rows=False)
    return {"checks": [{"path": r["path"], "output": r["output"], "run": True, "cudnn_error": r["cudnn"],
                        "blockwise_bf16_error": r["blockwise_bf16"], "ok": r["ok"]} for r in rows]}


def kernel_checks(args) -> dict:
    """gpu_kernels' checks: the Triton grouped matmul and the chunked gated delta rule against float32."""
    from gpu_kernels import check_all

    return {"checks": check_all(small=args.small)}


def rates(args, on_gpu: bool) -> list[dict]:
    """Achieved rates beside the planner's assumed ones (data sheet x default efficiency)."""
    from jlong.planner.pricing import Efficiency
    from jlong.planner.targets import GPUS

    gpu, eff = GPUS[args.target if args.target in GPUS else "h100"], Efficiency()
    gemm = gemm_flops_per_s(args.gemm)
    forward, backward = attention_flops_per_s(args, on_gpu)
    to_host, to_device = copy_bytes_per_s(args.copy_mib)
    hbm = hbm_bytes_per_s(args.copy_mib)
    tflops, gbs = 1e12, 1e9
    return [
        rate(f"bf16 GEMM {args.gemm}^3, TFLOP/s", gpu.peak_bf16_flops * eff.gemm / tflops, gemm / tflops,
             f"gemm {eff.gemm} x {gpu.peak_bf16_flops / tflops:g}"),
        rate(f"{'cuDNN' if on_gpu else 'blockwise'} causal attention forward, {args.attention_len:,} tokens, TFLOP/s",
             gpu.peak_bf16_flops * eff.attention_fwd / tflops, forward / tflops,
             f"attention_fwd {eff.attention_fwd} x {gpu.peak_bf16_flops / tflops:g}"),
        rate(f"{'cuDNN' if on_gpu else 'blockwise'} causal attention backward, {args.attention_len:,} tokens, TFLOP/s",
             gpu.peak_bf16_flops * eff.attention_bwd / tflops, backward / tflops,
             f"attention_bwd {eff.attention_bwd} x {gpu.peak_bf16_flops / tflops:g}"),
        rate(f"elementwise read + write, {args.copy_mib:,} MiB, GB/s", gpu.hbm_bytes_per_s * eff.hbm / gbs, hbm / gbs,
             f"hbm {eff.hbm} x {gpu.hbm_bytes_per_s / gbs:g}"),
        rate(f"device -> pinned host, {args.copy_mib:,} MiB, GB/s", gpu.pcie_bytes_per_s * eff.links / gbs,
             to_host / gbs, f"links {eff.links} x PCIe {gpu.pcie_bytes_per_s / gbs:g}"),
        rate(f"pinned host -> device, {args.copy_mib:,} MiB, GB/s", gpu.pcie_bytes_per_s * eff.links / gbs,
             to_device / gbs, f"links {eff.links} x PCIe {gpu.pcie_bytes_per_s / gbs:g}"),
        *grouped_matmul_rates(args, gpu.peak_bf16_flops * eff.grouped_matmul,
                              f"grouped_matmul {eff.grouped_matmul} x {gpu.peak_bf16_flops / tflops:g}"),
        gated_delta_rate(args, gpu, eff),
    ]


def rate(name: str, assumed: float, measured: float, basis: str) -> dict:
    return {"name": name, "assumed": significant(assumed), "measured": significant(measured),
            "measured_over_assumed": significant(measured / assumed), "assumed_from": basis}


def significant(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: an interpreted kernel's rate on the CPU rounds to 0 at 3 decimals."""
    return float(f"{value:.{digits}g}")


def gemm_flops_per_s(n: int) -> float:
    import jax
    import jax.numpy as jnp

    a, b = (jax.random.normal(key, (n, n), jnp.bfloat16) for key in jax.random.split(jax.random.key(0)))
    return 2 * n**3 / median_seconds(jax.jit(lambda a, b: a @ b), a, b)


def attention_flops_per_s(args, on_gpu: bool) -> tuple[float, float]:
    """Causal attention forward and backward in the kernel a step runs there (cuDNN on a GPU, the blockwise
    kernel elsewhere), FLOPs counted as the planner counts cuDNN's calls (`jlong.attention.cudnn.price_call`)."""
    import jax
    import jax.numpy as jnp

    from jlong.attention.blockwise import BlockwiseStep
    from jlong.attention.cudnn import CudnnStep, call_flops, causal_fraction

    T, H, K, d = args.attention_len, args.heads, args.kv_heads, args.head_dim
    kernel = CudnnStep(2) if on_gpu else BlockwiseStep(256)
    keys = jax.random.split(jax.random.key(1), 4)
    q, do = (jax.random.normal(k, (1, T, H, d), jnp.bfloat16) for k in keys[:2])
    k, v = (jax.random.normal(key, (1, T, K, d), jnp.bfloat16) for key in keys[2:])
    forward = jax.jit(lambda q, k, v: kernel.forward(q, k, v, None, True))
    o, lse = forward(q, k, v)
    backward = jax.jit(lambda q, k, v, o, lse, do: kernel.backward(q, k, v, None, True, o, lse, do))
    flops = functools.partial(call_flops, 1, H, T, T, d, visible=causal_fraction(T))
    return (flops(backward=False) / median_seconds(forward, q, k, v),
            flops(backward=True) / median_seconds(backward, q, k, v, o, lse, do))


def grouped_matmul_rates(args, assumed_flops: float, basis: str) -> list[dict]:
    """The experts' grouped matmul as routed rows (ROWS rows of K in GROUPS groups of near-equal size, as a
    balanced router leaves them), FLOPs counted for the routed rows only (as the planner counts the Triton
    kernels): jlong's Triton kernels forward and backward (both gradients), and XLA's `ragged_dot` forward
    on 8 of the groups (XLA:GPU may multiply every row by every group's matrix: at all the groups, minutes)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jlong.moe.grouped_matmul_triton import grouped_matmul

    rows, k, n, groups = args.experts
    interpret = jax.default_backend() != "gpu"
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    w = jax.random.normal(keys[1], (groups, k, n), jnp.bfloat16)
    dy = jax.random.normal(keys[2], (rows, n), jnp.bfloat16)

    def balanced(groups):
        return jnp.asarray(np.random.default_rng(0).multinomial(rows, np.full(groups, 1 / groups)), jnp.int32)

    sizes, eight = balanced(groups), balanced(8)
    triton = functools.partial(grouped_matmul, interpret=interpret)
    forward = jax.jit(triton)
    backward = jax.jit(lambda x, w, sizes, dy: jax.vjp(lambda x, w: triton(x, w, sizes), x, w)[1](dy))
    xla = jax.jit(jax.lax.ragged_dot)
    flops = 2.0 * rows * k * n
    tflops = 1e12
    shape = f"{rows:,} rows {k} -> {n}"
    return [
        rate(f"Triton grouped matmul forward, {shape}, {groups} groups, TFLOP/s", assumed_flops / tflops,
             flops / median_seconds(forward, x, w, sizes) / tflops, basis),
        rate(f"Triton grouped matmul backward (dx, dw), {shape}, {groups} groups, TFLOP/s", assumed_flops / tflops,
             2 * flops / median_seconds(backward, x, w, sizes, dy) / tflops, basis),
        rate(f"Triton grouped matmul forward, {shape}, 8 groups, TFLOP/s", assumed_flops / tflops,
             flops / median_seconds(forward, x, w[:8], eight) / tflops, basis),
        rate(f"XLA ragged_dot forward, {shape}, 8 groups, TFLOP/s", assumed_flops / tflops,
             flops / median_seconds(xla, x, w[:8], eight, repeats=2) / tflops, basis),
    ]


def gated_delta_rate(args, gpu, eff) -> dict:
    """The gated delta rule a step runs there (`kernels.gated_delta: auto`: Triton on a GPU, chunked on the CPU)
    forward and backward over --linear-len tokens of Qwen3.5-0.8B's linear attention (16 heads of 128), in
    tokens/s: measured, beside the planner's estimate of the very program that ran (priced as `jlong plan`
    prices a step: kernels, launches; on the rehearsal the CPU's program)."""
    import jax
    import jax.numpy as jnp

    from gpu_kernels import gated_delta_inputs
    from jlong.linear_attention.gated_delta import kernel_for, rule
    from jlong.planner.hlo import parse_module
    from jlong.planner.step_cost import estimate

    tokens, name = args.linear_len, kernel_for(jax.default_backend())
    inputs, segments, (do, dstate) = gated_delta_inputs(tokens, 16, 16, 128, 1)
    inputs = tuple(t.astype(jnp.bfloat16) for t in inputs[:3]) + inputs[3:]

    def forward_backward(inputs):
        (o, state), pullback = jax.vjp(rule(name), *inputs)
        return pullback((do.astype(o.dtype), dstate))

    step = jax.jit(forward_backward)
    program = parse_module(step.lower(inputs).compile().as_text())
    estimated = estimate(program, gpu=gpu, efficiency=eff, node_of=[0], tokens_per_step=tokens,
                         model_flops_per_device=1.0)
    return rate(f"{name} gated delta rule forward + backward, {tokens:,} tokens, 16 heads of 128, tokens/s",
                estimated.tokens_per_s, tokens / median_seconds(step, inputs),
                f"jlong plan's estimate of this program ({estimated.kernels:,.0f} kernel launches "
                f"at launch_us {eff.launch_us:g})")


def hbm_bytes_per_s(mib: int) -> float:
    """Device memory read and written by one elementwise kernel (what the planner prices "other kernels" at)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((mib, 2**19), jnp.bfloat16)
    return 2 * x.nbytes / median_seconds(jax.jit(lambda x: x * 2 + 1), x)


def copy_bytes_per_s(mib: int) -> tuple[float, float]:
    """Device -> pinned host and back: what host offload moves."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    x = jax.device_put(jnp.ones((mib, 2**19), jnp.bfloat16), on_device)  # mib MiB
    size = x.nbytes
    host = jax.device_put(x, pinned)
    to_host = size / median_seconds(lambda: jax.device_put(x, pinned))
    return to_host, size / median_seconds(lambda: jax.device_put(host, on_device))


# --------------------------------------------------------------------------
# The report


class Report:
    """gpu-truth.json and gpu-truth.md, rewritten as each part lands (a run cut short keeps what it measured)."""

    def __init__(self, out: Path, *, command: str, rehearse: bool, target: str):
        self.out = out
        self.data = {"command": command, "rehearsal": rehearse, "target": target, "commit": commit(),
                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "device": None, "versions": None, "cudnn_checks": [], "kernel_checks": [], "rates": [],
                     "cases": [],
                     "user_run": None, "wall_s": None}
        if rehearse:
            self.data["cudnn_checks"] = [{"path": path, "run": False, "why": "no GPU: cuDNN runs on NVIDIA GPUs only"}
                                         for path in CUDNN_PATHS]

    def rates(self, result: dict) -> None:
        if "failed" in result:
            self.data["rates_failed"] = result["failed"]
        else:
            self.data.update({key: result[key] for key in ("device", "versions", "rates")})
        self.write()

    def checks(self, part: str, result: dict) -> None:
        """A checking part's rows ("cudnn", "kernels"), or why it failed."""
        if "failed" in result:
            self.data[f"{part}_failed"] = result["failed"]
        else:
            self.data[{"cudnn": "cudnn_checks", "kernels": "kernel_checks"}[part]] = result["checks"]
        self.write()

    def user_run(self, outcome: dict) -> None:
        losses = outcome["losses"]
        outcome["loss_finite"] = bool(losses) and all(math.isfinite(x) for x in losses)
        outcome["loss_falling"] = len(losses) >= 6 and statistics.mean(losses[-3:]) < statistics.mean(losses[:3])
        self.data["user_run"] = outcome
        self.write()

    def cases(self, measured: list[dict], plans: dict) -> None:
        if "failed" in plans:
            self.data["plans_failed"] = plans["failed"]
        rows = []
        for case in measured:
            row = {key: case.get(key) for key in ("name", "model", "seq_len", "memory", "measured_peak_bytes",
                                                    "measured_step_s", "step_times_s", "losses")}
            plan = plans.get(case["name"], {})
            row.update(planned_bytes=plan.get("planned_bytes"), estimated_step_s=plan.get("estimated_step_s"),
                       planned_host_bytes=plan.get("planned_host_bytes"))
            for key in ("failed", "skipped", "plan_failed"):
                if case.get(key) or plan.get(key):
                    row[key] = case.get(key) or plan.get(key)
            rows.append(row)
        self.data["cases"] = rows
        self.write()

    def finish(self, wall_s: float) -> None:
        self.data["wall_s"] = round(wall_s, 1)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu-truth.json").write_text(json.dumps(self.data, indent=1) + "\n")
        (self.out / "gpu-truth.md").write_text(self.markdown())

    def markdown(self) -> str:
        d = self.data
        device, found = d["device"] or {}, d["versions"] or {}
        where = device.get("kind", "?") + (f" ({device['machine']})" if "machine" in device else "")
        stack = ", ".join(f"{k} {v}" for k, v in found.items() if v)
        title = "GPU truth: rehearsal on CPU" if d["rehearsal"] else "GPU truth: jlong's promises against one GPU"
        parts = [f"# {title}",
                 f"`{d['command']}` at commit {d['commit'] or '?'}, {d['date']}, {d['wall_s'] or '?'} s in all. "
                 f"Device: {where}. {stack}. Plans for target `{d['target']}`: memory from the compiled program, "
                 "step time an estimate read from it (never a measurement); measured times are medians of steps "
                 f"{WARMUP_STEPS + 1}-{TRAIN_STEPS} of `jlong train`, peaks `peak_bytes_in_use`."]
        parts += ["## cuDNN against the float32 blockwise kernel", self._cudnn_table()]
        if d.get("cudnn_failed"):
            parts.append(f"The cuDNN checks FAILED: {d['cudnn_failed']}")
        parts += ["## Qwen3.5's kernels against float32 references (`experiments/gpu_kernels.py`)",
                  self._kernels_table()]
        if d.get("kernels_failed"):
            parts.append(f"The kernel checks FAILED: {d['kernels_failed']}")
        parts += ["## Training cases: planned against measured", self._cases_table()]
        if d.get("plans_failed"):
            parts.append(f"Plans failed: {d['plans_failed']}")
        parts += ["## Rates: assumed by `jlong plan` against measured", self._rates_table()]
        if d.get("rates_failed"):
            parts.append(f"The rates FAILED: {d['rates_failed']}")
        run = d["user_run"]
        if run:
            peak = f"{run['measured_peak_bytes'] / GIB:.2f} GiB" if run["measured_peak_bytes"] else "not reported"
            losses = run["losses"]
            parts += ["## `jlong train` as a user runs it",
                      f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
                      f"(finite: {run['loss_finite']}, falling: {run['loss_falling']}), peak {peak}"
                      + (f"; FAILED {run['failed']}" if run.get("failed") else "") if losses
                      else f"no step ran: {run.get('failed')}"]
        return "\n\n".join(parts) + "\n"

    def _cudnn_table(self) -> str:
        checks = self.data["cudnn_checks"]
        if checks and not checks[0]["run"]:
            return f"Not run: {checks[0]['why']} ({', '.join(c['path'] for c in checks)})."
        rows = [[c["path"], c["output"], f"{c['cudnn_error']:.2e}", f"{c['blockwise_bf16_error']:.2e}",
                 "ok" if c["ok"] else "TOO FAR"] for c in checks]
        return markdown_table(["path", "output", "cuDNN error", "blockwise bf16 error", ""], rows)

    def _kernels_table(self) -> str:
        rows = [[c["kernel"], c["output"], f"{c['error']:.2e}", f"{c['yardstick']:.2e}", f"{c['scale']:.2e}",
                 "ok" if c["ok"] else "TOO FAR"] for c in self.data["kernel_checks"]]
        return markdown_table(["kernel", "output", "error", "yardstick", "output scale", ""], rows)

    def _cases_table(self) -> str:
        def gib(v):
            return f"{v / GIB:.2f}" if v else "-"

        def seconds(v):
            return f"{v:.3f}" if v else "-"

        def ratio(a, b):
            return f"{a / b:.2f}" if a and b else "-"

        rows = [[c["model"], c["seq_len"], c["memory"], gib(c["planned_bytes"]), gib(c["measured_peak_bytes"]),
                 ratio(c["measured_peak_bytes"], c["planned_bytes"]), seconds(c["estimated_step_s"]),
                 seconds(c["measured_step_s"]), ratio(c["measured_step_s"], c["estimated_step_s"]),
                 c.get("failed") or c.get("skipped") or c.get("plan_failed") or ""]
                for c in self.data["cases"]]
        return markdown_table(["model", "seq_len", "memory.remat", "planned GiB", "measured peak GiB",
                               "measured / planned", "estimated s", "measured s", "measured / estimated", "note"], rows)

    def _rates_table(self) -> str:
        rows = [[r["name"], f"{r['assumed']:g}", f"{r['measured']:g}", f"{r['measured_over_assumed']:.2f}",
                 r["assumed_from"]] for r in self.data["rates"]]
        return markdown_table(["rate", "assumed", "measured", "measured / assumed", "assumption"], rows)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], Path(sys.argv[4]), sys.argv[5:]))
    sys.exit(main())
