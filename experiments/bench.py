"""jlong against the PyTorch baseline on one machine: speed, memory, and the
longest context each trains.

    python experiments/bench.py speed CONFIG.yaml [key=value ...] [--reps 3] [--steps 6]
        [--device cuda] [--checkpointing] [--out experiments/results/bench-speed.md]
    python experiments/bench.py longest CONFIG.yaml [key=value ...] [--budget-gib N] [--target h100]
        [--device cuda] [--checkpointing] [--out experiments/results/bench-longest.md]

Both start from the same Hugging Face checkpoint (`model.hf_path`, or a
random one written from the config's architecture) and the same random token
file. Every run is its own process, jlong and PyTorch alternating, so neither
inherits the other's memory; each figure is the median over the repetitions
of the median over steps after the first (which holds jlong's compilation).
MFU counts model FLOPs with causal attention once (`jlong.families.Family.flops_per_token`),
for both, against the device's dense bf16 peak.

`longest`: jlong's longest length comes from `jlong maxlen` (planned by the
compiler of `--target`, by default `jlong maxlen`'s own) and is confirmed by a
real training step; PyTorch's by doubling the sequence until a step fails with out of
memory, then bisecting once between the last two lengths.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import GIB, commit, invocation, machine, today

from jlong.config import Config, load_config
from jlong.hf_config import hf_config_dict
from jlong.families import family_of
from jlong.planner.targets import PEAK_BF16_FLOPS

HERE = Path(__file__).resolve().parent


def prepare_inputs(config: Config, work: Path, tokens_needed: int) -> list[str]:
    """Overrides that point both runs at one HF checkpoint and one token file."""
    import torch
    import transformers

    overrides = []
    if not config.model.hf_path:
        hf_dir = work / "hf"
        if not (hf_dir / "config.json").is_file():
            torch.manual_seed(0)
            hf_config = transformers.AutoConfig.for_model(**hf_config_dict(config.model))
            transformers.AutoModelForCausalLM.from_config(hf_config).save_pretrained(hf_dir)
        overrides.append(f"model.hf_path={hf_dir}")
    tokens = work / "tokens.npy"
    if not tokens.is_file() or len(np.load(tokens, mmap_mode="r")) < tokens_needed:
        rng = np.random.default_rng(0)
        np.save(tokens, rng.integers(0, config.model.vocab_size, size=tokens_needed, dtype=np.int32))
    return [*overrides, "data.source=tokens", f"data.path={tokens}", "data.shuffle=false", "data.eos_id=null"]


def run_jlong(config_path: str, overrides: list[str], run_dir: Path) -> list[dict] | None:
    command = [sys.executable, "-m", "jlong", "train", config_path, *overrides, f"run_dir={run_dir}", "checkpoint.dir=null"]
    return _run(command, run_dir)


def run_torch(config_path: str, overrides: list[str], run_dir: Path, device: str, checkpointing: bool) -> list[dict] | None:
    command = [sys.executable, str(HERE / "torch_baseline.py"), config_path, *overrides, "--run-dir", str(run_dir),
               "--device", device, *(["--checkpointing"] if checkpointing else [])]
    return _run(command, run_dir)


def _run(command: list[str], run_dir: Path) -> list[dict] | None:
    """The run's metric records, or None when it failed (out of memory, say)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    metrics = run_dir / "metrics.jsonl"
    if result.returncode != 0 or not metrics.is_file():
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
        print(f"    failed: {tail[0][:200]}", flush=True)
        return None
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(records: list[dict], flops_per_token: float, peak_flops: float | None) -> dict:
    later = records[1:] or records
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in later)
    peak = max((r.get("peak_bytes") or 0) for r in records)
    return {
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / peak_flops if peak_flops else None,
        "peak_gib": peak / GIB if peak else None,
        "loss": records[-1]["loss"],
    }


def device_description(device: str) -> tuple[str, float | None]:
    if device == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None
    import torch

    name = torch.cuda.get_device_name()
    peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
    return name, peak


def provenance(device: str) -> str:
    import jax
    import torch
    import transformers

    name, _ = device_description(device)
    return (f"Device: {name} (host: {machine()}). jax {jax.__version__}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}. Command: `{invocation(__file__)}` at commit {commit() or 'unknown'} "
            f"on {today()}.")


def speed(args, config: Config) -> str:
    steps = args.steps
    work = Path(args.work or tempfile.mkdtemp(prefix="jlong-bench-"))
    shared = prepare_inputs(config, work, steps * config.train.batch_size * config.train.seq_len + 1)
    overrides = [*args.overrides, *shared, f"train.steps={steps}"]
    _, peak_flops = device_description(args.device)
    flops = family_of(config.model).flops_per_token(config.model, config.train.seq_len)
    results = {"jlong": [], "torch": []}
    for rep in range(args.reps):
        for name in ("jlong", "torch") if rep % 2 == 0 else ("torch", "jlong"):
            print(f"  repetition {rep + 1}: {name}", flush=True)
            run_dir = work / f"{name}-{rep}"
            records = (run_jlong(args.config, overrides, run_dir) if name == "jlong"
                       else run_torch(args.config, overrides, run_dir, args.device, args.checkpointing))
            if records:
                results[name].append(summarize(records, flops, peak_flops))
    rows = []
    for name, reps in results.items():
        if not reps:
            rows.append(f"| {name} | failed | | | |")
            continue
        median = {k: statistics.median(r[k] for r in reps) if reps[0][k] is not None else None for k in reps[0]}
        mfu = f"{median['mfu']:.1%}" if median["mfu"] is not None else "-"
        peak = f"{median['peak_gib']:.2f}" if median["peak_gib"] is not None else "-"
        rows.append(f"| {name} | {median['tokens_per_s']:,.0f} | {mfu} | {peak} | {len(reps)} |")
    t = config.train
    return "\n".join([
        f"# Speed: {config.model.num_hidden_layers}-layer model, seq_len {t.seq_len:,} x batch {t.batch_size}",
        provenance(args.device), "",
        "| run | tokens/s (median) | MFU | peak GiB | repetitions |", "|---|---|---|---|---|", *rows, "",
    ])


def longest(args, config: Config) -> str:
    work = Path(args.work or tempfile.mkdtemp(prefix="jlong-bench-"))
    target = ["--target", args.target] if args.target else []
    budget = ["--budget-gib", str(args.budget_gib)] if args.budget_gib else []
    command = [sys.executable, "-m", "jlong", "maxlen", args.config, *args.overrides, *budget, *target]
    found = subprocess.run(command, capture_output=True, text=True)
    match = re.search(r"longest seq_len that fits: ([\d,]+)", found.stdout)
    planned = int(match.group(1).replace(",", "")) if match else 0
    print(found.stdout, flush=True)
    jlong_ok = False
    if planned:
        shared = prepare_inputs(config, work, 2 * config.train.batch_size * planned + 1)
        jlong_ok = run_jlong(args.config, [*args.overrides, *shared, f"train.seq_len={planned}", "train.steps=2"],
                             work / "jlong-longest") is not None
    torch_best = torch_longest(args, config, work)
    return "\n".join([
        "# Longest context that trains",
        provenance(args.device), "",
        "| run | longest seq_len | how |", "|---|---|---|",
        f"| jlong | {planned:,} | `jlong maxlen {' '.join(budget + target)}`; a real 2-step run at that length "
        f"{'succeeded' if jlong_ok else 'FAILED'} |",
        f"| torch | {torch_best:,} | doubling until out of memory, then one bisection |", "",
    ])


def torch_longest(args, config: Config, work: Path) -> int:
    def trains(seq_len: int) -> bool:
        print(f"  torch at seq_len {seq_len:,}", flush=True)
        shared = prepare_inputs(config, work, 2 * config.train.batch_size * seq_len + 1)
        overrides = [*args.overrides, *shared, f"train.seq_len={seq_len}", "train.steps=2"]
        return run_torch(args.config, overrides, work / f"torch-{seq_len}", args.device, args.checkpointing) is not None

    low, high = 0, args.torch_start
    while trains(high):
        low, high = high, 2 * high
    if low and trains((low + high) // 2):
        low = (low + high) // 2
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("speed", "longest"))
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--checkpointing", action="store_true", help="the baseline's gradient checkpointing")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--budget-gib", type=float, help="per device (default: jlong maxlen's, from "
                        "train.gpu_memory_fraction)")
    parser.add_argument("--target", help="jlong maxlen's --target (h100, h200, b200, cpu)")
    parser.add_argument("--torch-start", type=int, default=8192, help="first length the baseline tries")
    parser.add_argument("--work", help="scratch directory (default: a new temporary one)")
    parser.add_argument("--out", type=Path, help="write the Markdown result here")
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    text = speed(args, config) if args.mode == "speed" else longest(args, config)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
