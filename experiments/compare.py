"""Two training runs side by side: per step loss, grad norm, tokens/s and peak
memory, their ratios, and both loss curves in one PNG.

    python experiments/compare.py RUN_A RUN_B [--plot losses.png]
    python experiments/compare.py --config CONFIG.yaml [key=value ...] --out DIR [--device cuda]

The first form reads two run directories (their metrics.jsonl); the second
trains the config with jlong (DIR/jlong) and with the PyTorch baseline
(DIR/torch) first. Labels are the directories' names.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from jlong.planner.targets import GIB


def fail(message: str, status: int = 2):
    """One line on stderr and the exit status, as jlong's own errors."""
    print(f"compare: error: {message}", file=sys.stderr)
    raise SystemExit(status)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        fail(f"{path} does not exist")
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def side_by_side(a: dict[int, dict], b: dict[int, dict], names: tuple[str, str]) -> str:
    steps = sorted(set(a) & set(b))
    columns = [("loss", "{:.5f}"), ("grad_norm", "{:.4f}"), ("tokens_per_s", "{:,.0f}"), ("peak_bytes", "{:.2f}")]
    header = "step " + " ".join(f"{f'{key} {name}':>20}" for key, _ in columns for name in names) + "   loss rel diff"
    lines = [header]
    for step in steps:
        cells = []
        for key, fmt in columns:
            for run in (a, b):
                value = run[step].get(key)
                if key == "peak_bytes" and value is not None:
                    value /= GIB
                cells.append(f"{fmt.format(value) if value is not None else '-':>20}")
        diff = abs(a[step]["loss"] - b[step]["loss"]) / abs(b[step]["loss"])
        lines.append(f"{step:>4} " + " ".join(cells) + f"   {diff:.2e}")
    lines.append("")
    lines += ratios(a, b, steps, names)
    return "\n".join(lines)


def ratios(a, b, steps, names) -> list[str]:
    """Medians after the first step (which includes compilation in jlong)."""
    later = steps[1:] or steps
    out = [f"max loss rel diff: {max(abs(a[s]['loss'] - b[s]['loss']) / abs(b[s]['loss']) for s in steps):.2e}"]
    for key, label in (("tokens_per_s", "median tokens/s"), ("peak_bytes", "peak memory")):
        if all(a[s].get(key) and b[s].get(key) for s in later):
            va, vb = statistics.median(a[s][key] for s in later), statistics.median(b[s][key] for s in later)
            out.append(f"{label}: {names[0]} {va:,.0f} / {names[1]} {vb:,.0f} = {va / vb:.3f}")
    return out


def plot_losses(a, b, names, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run, name in zip((a, b), names):
        steps = sorted(run)
        ax.plot(steps, [run[s]["loss"] for s in steps], label=name, marker="." if len(steps) < 60 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_both(config: str, overrides: list[str], out: Path, device: str) -> tuple[Path, Path]:
    ours, theirs = out / "jlong", out / "torch"
    baseline = Path(__file__).resolve().parent / "torch_baseline.py"
    for name, command in (
        ("jlong", [sys.executable, "-m", "jlong", "train", config, *overrides, f"run_dir={ours}"]),
        ("the PyTorch baseline", [sys.executable, str(baseline), config, *overrides, "--run-dir", str(theirs),
                                  "--device", device]),
    ):
        status = subprocess.run(command).returncode  # its own error line is already on stderr
        if status:
            fail(f"{name} exited with status {status}", status)
    return ours, theirs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="two run directories, or with --config: key=value overrides")
    parser.add_argument("--config", help="train this config with jlong and with the PyTorch baseline first")
    parser.add_argument("--out", type=Path, help="with --config: where the two runs go")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="the baseline's device")
    parser.add_argument("--plot", type=Path, help="write both loss curves to this PNG")
    args = parser.parse_args(argv)
    if args.config:
        if not args.out:
            parser.error("--config needs --out")
        first, second = run_both(args.config, args.runs, args.out, args.device)
    elif len(args.runs) == 2:
        first, second = map(Path, args.runs)
    else:
        parser.error("give two run directories, or --config CONFIG --out DIR")
    names = (first.name, second.name)
    a, b = read_metrics(first), read_metrics(second)
    print(side_by_side(a, b, names))
    if args.plot:
        plot_losses(a, b, names, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
