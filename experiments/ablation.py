"""The long-context ablation, computed by the planner on 8 virtual CPU devices:
each row adds one layer of the memory stack, and reports per-device GiB at
3M and 5M tokens and the longest context that fits the budget.

    python experiments/ablation.py [--models llama3-8b qwen3-32b] [--budget-gib 80]

Writes experiments/results/ablation.md, ablation.json and ablation.png.

The FSDP row is data parallel: each of the 8 devices holds one whole
sequence (batch 8); from the Ulysses row on, one sequence is split over
sp = 8 (batch 1). Parameters, gradients and optimizer state are sharded over
all 8 devices in every row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from common import RESULTS, markdown_table, provenance, use_cpu_devices, write_result

use_cpu_devices(8)

from jlong.config import load_config  # noqa: E402
from jlong.maxlen import longest_seq_len  # noqa: E402
from jlong.plan import GIB, plan  # noqa: E402

COMMON = ["train.compute_dtype=bfloat16", "train.param_dtype=float32", "attention.impl=blockwise",
          "attention.block_size=1024", "data.source=synthetic"]
FSDP = ["mesh.fsdp=8", "mesh.sp=1", "train.batch_size=8", "attention.heads_per_stage=0"]
ULYSSES = ["mesh.fsdp=1", "mesh.sp=8", "train.batch_size=1", "attention.heads_per_stage=0"]
CHECKPOINT = ["memory.remat=save_inputs"]
OFFLOAD = ["memory.remat=offload_inputs"]
TILES = ["memory.mlp_tile=2500", "memory.loss_tile=1000"]  # divide 3M/8 and 5M/8


def rows_for(model: str) -> list[tuple[str, list[str]]]:
    stack = [
        ("FSDP (8 devices, one sequence each)", FSDP),
        ("+ Ulysses (sp = 8)", ULYSSES),
        ("+ checkpointing (save_inputs)", ULYSSES + CHECKPOINT),
        ("+ host offload (offload_inputs)", ULYSSES + OFFLOAD),
        ("+ tiled MLP and loss", ULYSSES + OFFLOAD + TILES),
    ]
    full = ULYSSES + OFFLOAD + TILES
    if model.startswith("qwen3-32b"):
        stack.append(("+ UPipe (U = 2C = 16)", full + ["attention.heads_per_stage=16"]))
    stack.append(("+ UPipe (U = C = 8)", full + ["attention.heads_per_stage=8"]))
    return stack


def run_model(model: str, lengths: list[int], budget_gib: float) -> list[dict]:
    results = []
    for name, overrides in rows_for(model):
        config = load_config(None, [f"model.preset={model}", *COMMON, *overrides, f"train.seq_len={lengths[0]}"])
        started = time.perf_counter()
        plans = {n: plan(load_config(None, [f"model.preset={model}", *COMMON, *overrides, f"train.seq_len={n}"]),
                         budget_gib=budget_gib) for n in lengths}
        found = longest_seq_len(config, budget_gib=budget_gib)
        results.append({"name": name, "plans": plans, "maxlen": found.seq_len})
        gib = ", ".join(f"{n / 1e6:g}M: {p.device_total / GIB:,.1f} GiB" for n, p in plans.items())
        print(f"{model} | {name} | {gib} | longest {found.seq_len:,} | {time.perf_counter() - started:.0f}s", flush=True)
    return results


def table(results: list[dict], lengths: list[int]) -> str:
    headers = ["stack", *(f"device GiB at {n / 1e6:g}M" for n in lengths),
               *(f"host GiB at {n / 1e6:g}M" for n in lengths), "longest context that fits"]
    rows = []
    for r in results:
        device = [f"{r['plans'][n].device_total / GIB:,.1f}" for n in lengths]
        host = [f"{r['plans'][n].host_offload / GIB:,.1f}" for n in lengths]
        rows.append([r["name"], *device, *host, f"{r['maxlen']:,}"])
    return markdown_table(headers, rows)


def monotone_notes(results: list[dict], lengths: list[int]) -> list[str]:
    """Rows that do not lower the device bytes of the row before, with why."""
    notes = []
    for before, after in zip(results, results[1:]):
        for n in lengths:
            if after["plans"][n].device_total >= before["plans"][n].device_total:
                notes.append(f"{after['name']} at {n / 1e6:g}M does not lower the device bytes "
                             f"({before['plans'][n].device_total / GIB:.1f} -> {after['plans'][n].device_total / GIB:.1f} GiB)")
    return notes


def chart(all_results: dict[str, list[dict]], lengths: list[int], budget_gib: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(7 * len(all_results), 5.5), squeeze=False)
    width = 0.8 / len(lengths)
    for ax, (model, results) in zip(axes[0], all_results.items()):
        for i, n in enumerate(lengths):
            values = [r["plans"][n].device_total / GIB for r in results]
            ax.bar([x + i * width for x in range(len(results))], values, width, label=f"{n / 1e6:g}M tokens")
        ax.axhline(budget_gib, color="black", linestyle="--", linewidth=1, label=f"{budget_gib:g} GiB budget")
        ax.set_yscale("log")
        ax.set_xticks([x + width * (len(lengths) - 1) / 2 for x in range(len(results))])
        ax.set_xticklabels([r["name"] for r in results], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("planned GiB per device")
        ax.set_title(f"{model} on 8 devices")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-32b"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[3_000_000, 5_000_000])
    parser.add_argument("--budget-gib", type=float, default=80.0)
    args = parser.parse_args()

    all_results = {model: run_model(model, args.lengths, args.budget_gib) for model in args.models}
    sections = [
        "# Long-context ablation, planned per device",
        provenance("python experiments/ablation.py " + " ".join(sys.argv[1:])),
        __doc__.split("\n\n")[3].replace("\n", " "),
        f"Budget {args.budget_gib:g} GiB per device; bf16 compute, float32 parameters and AdamW state; "
        "host GiB is what `offload_inputs` keeps in pinned host memory per device.",
    ]
    for model, results in all_results.items():
        states = results[-1]["plans"][args.lengths[0]]
        fixed = (states.parameters + states.gradients + states.optimizer_state) / GIB
        sections += [
            f"## {model}",
            f"Parameters, gradients and AdamW state: {fixed:.1f} GiB per device in every row, before any "
            "activation. A longest context of 0 means no length fits.",
            table(results, args.lengths),
        ]
        notes = monotone_notes(results, args.lengths)
        sections.append("Each row lowers the device bytes of the row before."
                        if not notes else "Rows that do not lower the device bytes:\n\n" + "\n".join(f"- {n}" for n in notes))
    sections.append("![ablation](ablation.png)")
    text = "\n\n".join(sections) + "\n"
    RESULTS.mkdir(exist_ok=True)
    chart(all_results, args.lengths, args.budget_gib, RESULTS / "ablation.png")
    raw = {model: [{"stack": r["name"], "longest": r["maxlen"],
                    **{str(n): p.as_dict() for n, p in r["plans"].items()}} for r in results]
           for model, results in all_results.items()}
    write_result("ablation.json", json.dumps(raw, indent=1) + "\n")
    print(text)
    print(f"wrote {write_result('ablation.md', text)}, ablation.png and ablation.json")


if __name__ == "__main__":
    main()
