"""The planner against reality on this machine's one device: for each
sequence length, what `jlong plan` says the train step needs (with the CPU
compiler, and with the GPU compiler of `--gpu-target` where the CUDA plugin
is installed) next to the peak bytes a real 2-step `jlong train` run measured.

    python experiments/plan_check.py CONFIG.yaml [key=value ...] --seq-lens 32768 65536 131072
        [--gpu-target h100] [--out experiments/results/plan_vs_peak.md]

The config's mesh must be one device. Every plan and run is its own process,
so none inherits another's memory. On CPU the measured column stays empty
(XLA:CPU reports no peak); that is how the script is tested.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import GIB, commit, invocation, machine, markdown_table, today

from jlong.planner.targets import cuda_plugin_installed



def jlong(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    return subprocess.run([sys.executable, "-m", "jlong", *args], env=env, capture_output=True, text=True)


def describe_device() -> list[str]:
    """(platform, device kind, jax version), asked of a child process so that
    this one holds no GPU memory while the runs measure theirs."""
    probe = "import jax; d = jax.devices()[0]; print(d.platform, jax.__version__, d.device_kind, sep='|')"
    platform, version, kind = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                             check=True).stdout.strip().split("|")
    return [platform, kind, version]


def planned_bytes(config: str, overrides: list[str], target: str) -> int | None:
    result = jlong("plan", config, *overrides, "--json", "--target", target)
    if not result.stdout.strip():  # a plan over its budget still prints its bytes (and exits 2)
        print(f"    plan --target {target} failed: {result.stderr.strip()[-300:]}", flush=True)
        return None
    return json.loads(result.stdout)["device_total"]


def measured_peak(config: str, overrides: list[str], run_dir: Path) -> int | None | str:
    """The largest `peak_bytes` of a 2-step run; None where the device reports
    none (CPU); "failed" when the run did not finish (out of memory, say)."""
    result = jlong("train", config, *overrides, "train.steps=2", "checkpoint.dir=null", f"run_dir={run_dir}")
    metrics = run_dir / "metrics.jsonl"
    if result.returncode != 0 or not metrics.is_file():
        print(f"    train failed: {result.stderr.strip()[-300:]}", flush=True)
        return "failed"
    peaks = [json.loads(line).get("peak_bytes") for line in metrics.read_text().splitlines()]
    return max(peaks) if all(peaks) else None


def in_unit(value, size: int) -> str:
    return f"{value / size:,.2f}" if isinstance(value, int) else (value or "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--seq-lens", nargs="+", type=int, required=True)
    parser.add_argument("--gpu-target", default="h100", help="the GPU this machine has: h100, h200, b200")
    parser.add_argument("--out", type=Path, help="write the Markdown result here")
    args = parser.parse_args(argv)

    platform, device_kind, jax_version = describe_device()
    gpu_compiler = cuda_plugin_installed()
    work = Path(tempfile.mkdtemp(prefix="jlong-plan-check-"))
    measured = []
    for seq_len in args.seq_lens:
        print(f"seq_len {seq_len:,}", flush=True)
        overrides = [*args.overrides, f"train.seq_len={seq_len}"]
        cpu_plan = planned_bytes(args.config, overrides, "cpu")
        gpu_plan = planned_bytes(args.config, overrides, args.gpu_target) if gpu_compiler else None
        measured.append((seq_len, cpu_plan, gpu_plan, measured_peak(args.config, overrides, work / str(seq_len))))
    largest = max((v for row in measured for v in row[1:] if isinstance(v, int)), default=0)
    unit, size = ("GiB", GIB) if largest >= GIB else ("MiB", 2**20)
    rows = []
    for seq_len, cpu_plan, gpu_plan, peak in measured:
        reference = gpu_plan or cpu_plan
        ratio = f"{peak / reference:.3f}" if isinstance(peak, int) and reference else "-"
        rows.append([seq_len, *(in_unit(v, size) for v in (cpu_plan, gpu_plan, peak)), ratio])
    text = "\n\n".join([
        "# The plan against the measured peak",
        f"Device: {device_kind} ({platform}; host: {machine()}). jax {jax_version}. Command: "
        f"`{invocation(__file__, argv)}` at commit {commit() or 'unknown'} on {today()}. "
        f"{unit} per device; the measured peak is `peak_bytes_in_use` over a 2-step `jlong train` "
        "(XLA_PYTHON_CLIENT_PREALLOCATE=false); the ratio is measured over planned (GPU compiler where run).",
        markdown_table(["seq_len", "planned, CPU compiler", "planned, GPU compiler", "measured peak",
                        "measured / planned"], rows),
    ]) + "\n"
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
