"""Three ways to lay Llama3-8B at 1,048,576 tokens over one 8 x H100 node,
planned with the Python API only (docs/python.md walks through it): device
memory against the estimated step time, as a table and a figure.

    python experiments/compare_layouts.py [--target h100] [--seq-len 1048576]

Writes experiments/results/compare-layouts.md and compare-layouts.png. The
step times are estimates read from the compiled XLA:GPU programs, never
measurements.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jlong
from common import invocation, provenance

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "llama3-8b-5m.yaml"
LAYOUTS = {  # name -> overrides of the 5M config's layout
    "Ulysses (U = 32: every head at once)": ["attention.heads_per_stage=all"],
    "UPipe (U = 8 heads per stage)": ["attention.heads_per_stage=8"],
    "Ulysses 4 x ring 2 (U = 4)": ["mesh.ring=2", "mesh.sp=4", "attention.heads_per_stage=4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--seq-len", type=int, default=1_048_576)
    args = parser.parse_args()
    # the default stack's memory settings for every layout (the config's own are the planner's choice)
    plans = {name: jlong.plan(CONFIG, [f"train.seq_len={args.seq_len}", "memory.remat=offload_inputs", *overrides],
                              target=args.target)
             for name, overrides in LAYOUTS.items()}
    rows = ["| layout | GiB per device | host GiB per node | fits | step s (estimate) | tokens/s (estimate) |",
            "|---|---|---|---|---|---|"]
    for name, plan in plans.items():
        rows.append(f"| {name} | {plan.device_bytes / 2**30:.2f} | {plan.host_bytes_per_node / 2**30:,.0f} | "
                    f"{'yes' if plan.fits else 'no'} | {plan.step_time_s:,.1f} | {plan.tokens_per_s:,.0f} |")
    command = invocation(__file__, ["--target", args.target]
                         + (["--seq-len", str(args.seq_len)] if args.seq_len != 1_048_576 else []))
    header = (f"# Three layouts of Llama3-8B at {args.seq_len:,} tokens on one node\n\n"
              f"{provenance(command, f'XLA:GPU compiling for compile-only {args.target.upper()}s')} Through "
              f"`jlong.plan` (jlong {jlong.__version__}): the memory is "
              "the compiler's plan, the step time an estimate read from the compiled program on data-sheet "
              "rates (docs/planning.md), not a measurement.\n\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compare-layouts.md").write_text(header + "\n".join(rows) + "\n")
    print("\n".join(rows))
    _figure(plans, args.seq_len, RESULTS / "compare-layouts.png")


def _figure(plans: dict, seq_len: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for name, plan in plans.items():
        axes.scatter(plan.device_bytes / 2**30, plan.step_time_s, s=60)
        axes.annotate(name, (plan.device_bytes / 2**30, plan.step_time_s), textcoords="offset points",
                      xytext=(6, 6), fontsize=8)
    axes.margins(x=0.45, y=0.2)  # room for the labels
    axes.set_xlabel("device memory, GiB (planned by XLA:GPU)")
    axes.set_ylabel("step time, s (estimated)")
    axes.set_title(f"Llama3-8B, {seq_len:,} tokens, 8 x H100")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
