"""UPipe's published throughput table beside jlong's estimates: Llama3-8B on
one 8 x H100 node (128K ... 5M) and Qwen3-32B on two nodes (Ulysses 8 x ring
2, 128K ... 4M), each length planned with the default stack (every layer's
input in host memory, attention recomputed: `memory.remat=offload_inputs`,
U = sp) and with the settings `memory.remat=auto` with
`attention.heads_per_stage=auto` chooses.

    python experiments/upipe_table.py [--target h100]

Writes experiments/results/upipe-table.md and upipe-table.png. jlong's
numbers are estimates read from compiled programs; UPipe's are the authors'
measurements. Nothing is tuned to agree.
"""

from __future__ import annotations

import argparse
import sys

import jlong
from common import DEFAULT_STACK, GIB, RESULTS, ROOT, add_target_argument, estimate_assumptions, invocation, \
    markdown_table, plan, planning_target, provenance, write_result

MI = 2**20
# Tokens/s per GPU measured by the UPipe authors (arXiv 2602.21196, project page; torchtitan, FA3, full
# activation checkpointing with CPU offload, tiled MLP, batch 1), as DESIGN.md quotes them first-hand.
UPIPE = {
    "llama3-8b": {128 * 1024: 2281.05, 256 * 1024: 1487.29, 512 * 1024: 867.17, MI: 472.53, 2 * MI: 246.07,
                  3 * MI: 166.32, 4 * MI: 125.56, 5 * MI: 98.25},
    "qwen3-32b": {128 * 1024: 483.29, 256 * 1024: 339.56, 512 * 1024: 204.46, MI: 113.26, 2 * MI: 59.56,
                  3 * MI: 40.42, 4 * MI: 29.97},
}
LAYOUTS = {  # the UPipe authors' layouts, on jlong's default stack
    "llama3-8b": ("configs/llama3-8b-5m.yaml", []),
    "qwen3-32b": ("configs/qwen3-32b-8m-2nodes.yaml", ["memory.layers_per_checkpoint=1",
                                                         "memory.optimizer_offload=false"]),
}
AUTO = ["memory.remat=auto", "memory.remat_runs={}", "attention.heads_per_stage=auto"]


def planned(model: str, seq_len: int, settings: list[str], target):
    path, layout = LAYOUTS[model]
    return plan(jlong.load_config(ROOT / path, [*layout, *settings, f"train.seq_len={seq_len}"]), target)


def per_gpu(result) -> float:
    return result.cost.tokens_per_s / result.cost.devices


def chosen(result) -> str:
    config = result.config
    from jlong.planner.memory import describe_layers

    return f"{describe_layers(config)}; U={config.heads_per_stage}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--models", nargs="+", default=list(UPIPE), choices=list(UPIPE))
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows, series = [], {}
    for model in args.models:
        for seq_len, measured in UPIPE[model].items():
            default = planned(model, seq_len, DEFAULT_STACK, target)
            auto = planned(model, seq_len, AUTO, target)
            d, a = per_gpu(default), per_gpu(auto)
            rows.append([model, f"{seq_len:,}", f"{measured:,.2f}", f"{d:,.1f}", f"{d / measured:.2f}",
                         "yes" if default.fits else "no", f"{a:,.1f}", f"{a / measured:.2f}", f"{a / d:.3f}",
                         "yes" if auto.fits else "no", f"{auto.cost.recompute_factor:.2f}",
                         f"{auto.device_bytes / GIB:.2f}", f"{auto.host_bytes_per_node / GIB:,.0f}", chosen(auto)])
            print(" | ".join(rows[-1]), flush=True)
            series.setdefault(model, []).append((seq_len, measured, d, a))
    command = invocation(__file__, argv)
    print(f"wrote {write_report(rows, series, command, target)}")
    return 0


def write_report(rows: list[list], series: dict, command: str, target, note: str = "") -> str:
    """upipe-table.md (with `note` under its head) and its figure, from the rows and series `main` computed."""
    headers = ["model", "seq_len", "UPipe measured", "default: est.", "default / UPipe", "default fits",
               "auto: est.", "auto / UPipe", "auto / default", "auto fits", "auto exec/model",
               "auto GiB per device", "auto host GiB per node", "auto chose"]
    figure = _figure(series)
    text = "\n\n".join(part for part in [
        "# UPipe's published table beside jlong's estimates",
        provenance(command, target.compiler()),
        note,
        estimate_assumptions(target.name) + " Tokens/s per GPU: the mesh's tokens per step over the estimated "
        "step time and its devices. Nothing here ran on a GPU; UPipe's column is the authors' measurement "
        "(torchtitan, FA3, full activation checkpointing with CPU offload, tiled MLP, batch 1; arXiv 2602.21196), "
        "so each ratio sets an estimate of one system against a measurement of another, reported as it falls.",
        "Layouts: Llama3-8B on 8 GPUs with sp 8 (configs/llama3-8b-5m.yaml); Qwen3-32B on 16 GPUs with Ulysses "
        "8 x ring 2 (configs/qwen3-32b-8m-2nodes.yaml with one input per layer and the optimizer on the "
        "device, as the default stack has it). Default: every layer's input in host memory and attention "
        "recomputed (`offload_inputs`), U = sp. Auto: `memory.remat=auto` and `attention.heads_per_stage=auto`, "
        "the planner's choice within the default budgets (jlong.planner.memory_choice).",
        markdown_table(headers, rows),
        f"![tokens/s per GPU by length]({figure.name})",
    ] if part) + "\n"
    return write_result("upipe-table.md", text)


def _figure(series: dict):
    from jlong.plots import pyplot, save

    fig, axes = pyplot().subplots(1, len(series), figsize=(6 * len(series), 4.5), squeeze=False)
    for ax, (model, points) in zip(axes[0], series.items()):
        lengths = [p[0] for p in points]
        for index, label, style in ((1, "UPipe (measured)", "o-"), (2, "jlong default (estimate)", "s--"),
                                    (3, "jlong auto (estimate)", "^-")):
            ax.plot(lengths, [p[index] for p in points], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(lengths, [f"{n // 1024}K" if n < MI else f"{n // MI}M" for n in lengths])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("tokens/s per GPU")
        ax.set_title(model)
        ax.legend()
    path = RESULTS / "upipe-table.png"
    save(fig, path)
    return path


if __name__ == "__main__":
    sys.exit(main())
