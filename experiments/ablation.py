"""The long-context ablation, planned for one 8-GPU node: each row adds one
layer of the memory stack, and reports per-device GiB at 3M and 5M tokens
(3 x 2^20 and 5 x 2^20), host GiB per node, and the longest context that
fits both the device and the host budget.

    python experiments/ablation.py [--target h100] [--models llama3-8b qwen3-32b] [--budget-gib N]
        [--host-budget-gib 1536] [--no-cpu-proxy]

Plans compile with XLA:GPU for compile-only devices of `--target` (deviceless;
`pip install -e '.[gpu-plan]'`); each row is also planned with the CPU proxy
(`--target cpu`) at the same lengths, and the table gives the ratio between
the two. Writes experiments/results/ablation-MODELS.md, .json and .png.

The FSDP row is data parallel: each of the 8 devices holds one whole
sequence (batch 8); from the Ulysses row on, one sequence is split over
sp = 8 (batch 1). Parameters, gradients and optimizer state are sharded over
all 8 devices in every row.
"""

from __future__ import annotations

import argparse
import json
import time

import jlong
from common import GIB, RESULTS, add_target_argument, longest, invocation, markdown_table, plan, planning_target, \
    provenance, write_result

COMMON = ["train.compute_dtype=bfloat16", "train.param_dtype=float32", "attention.impl=auto",
          "attention.block_size=1024", "data.source=synthetic"]
FSDP = ["mesh.fsdp=8", "mesh.sp=1", "train.batch_size=8", "attention.heads_per_stage=all"]
ULYSSES = ["mesh.fsdp=1", "mesh.sp=8", "train.batch_size=1", "attention.heads_per_stage=all"]
CHECKPOINT = ["memory.remat=save_inputs"]
OFFLOAD = ["memory.remat=offload_inputs"]
TILES = ["memory.mlp_tile=2048", "memory.loss_tile=1024"]  # divide 3M/8 and 5M/8
MILLION = 2**20


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
    full += ["attention.heads_per_stage=8"]
    stack.append(("+ UPipe (U = C = 8)", full))
    stack.append(("+ optimizer in host memory", full + ["memory.optimizer_offload=true"]))
    stack.append(("+ one layer input per 2 layers", full + ["memory.optimizer_offload=true", "memory.layers_per_checkpoint=2"]))
    return stack


def run_model(model: str, lengths: list[int], target, cpu_proxy) -> list[dict]:
    results = []
    for name, overrides in rows_for(model):
        def config_at(n):
            return jlong.load_config(None, [f"model.preset={model}", *COMMON, *overrides, f"train.seq_len={n}"])

        started = time.perf_counter()
        plans = {n: plan(config_at(n), target).memory for n in lengths}
        proxy = {n: plan(config_at(n), cpu_proxy).memory for n in lengths} if cpu_proxy else {}
        found = longest(config_at(lengths[0]), target)
        results.append({"name": name, "plans": plans, "proxy": proxy, "maxlen": found.seq_len,
                        "bound_by": found.bound_by})
        gib = ", ".join(f"{n / MILLION:g}M: {p.device_total / GIB:,.1f} GiB" for n, p in plans.items())
        print(f"{model} | {name} | {gib} | longest {found.seq_len:,} ({found.bound_by} budget binds) | "
              f"{time.perf_counter() - started:.0f}s", flush=True)
    return results


def table(results: list[dict], lengths: list[int]) -> str:
    with_proxy = bool(results[0]["proxy"])
    headers = [
        "stack", *(f"device GiB at {n / MILLION:g}M" for n in lengths),
        f"host GiB per node at {lengths[-1] / MILLION:g}M",
        *([f"CPU proxy GiB at {n / MILLION:g}M (proxy / GPU)" for n in lengths] if with_proxy else []),
        "longest context that fits", "budget that binds",
    ]
    rows = []
    for r in results:
        device = [f"{r['plans'][n].device_total / GIB:,.1f}" for n in lengths]
        host = f"{r['plans'][lengths[-1]].host_per_node / GIB:,.0f}"
        proxy = [f"{r['proxy'][n].device_total / GIB:,.1f} ({r['proxy'][n].device_total / r['plans'][n].device_total:.2f}x)"
                 for n in lengths] if with_proxy else []
        rows.append([r["name"], *device, host, *proxy, f"{r['maxlen']:,}", r["bound_by"]])
    return markdown_table(headers, rows)


def monotone_notes(results: list[dict], lengths: list[int]) -> list[str]:
    """Rows that do not lower the device bytes of the row before, with why."""
    notes = []
    for before, after in zip(results, results[1:]):
        for n in lengths:
            if after["plans"][n].device_total >= before["plans"][n].device_total:
                notes.append(f"{after['name']} at {n / MILLION:g}M does not lower the device bytes "
                             f"({before['plans'][n].device_total / GIB:.1f} -> {after['plans'][n].device_total / GIB:.1f} GiB)")
    return notes


def chart(all_results: dict[str, list[dict]], lengths: list[int], budget_gib: float, target: str, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(7 * len(all_results), 5.5), squeeze=False)
    width = 0.8 / len(lengths)
    for ax, (model, results) in zip(axes[0], all_results.items()):
        for i, n in enumerate(lengths):
            values = [r["plans"][n].device_total / GIB for r in results]
            ax.bar([x + i * width for x in range(len(results))], values, width, label=f"{n / MILLION:g}M tokens")
        ax.axhline(budget_gib, color="black", linestyle="--", linewidth=1, label=f"{budget_gib:.1f} GiB budget")
        ax.set_yscale("log")
        ax.set_xticks([x + width * (len(lengths) - 1) / 2 for x in range(len(results))])
        ax.set_xticklabels([r["name"] for r in results], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"planned GiB per device ({target}, XLA's memory analysis)")
        ax.set_title(f"{model} on 8 x {target}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-32b"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[3 * MILLION, 5 * MILLION])
    parser.add_argument("--budget-gib", type=float, help="per device (default: the target's)")
    parser.add_argument("--host-budget-gib", type=float, default=1536.0, help="per node")
    parser.add_argument("--no-cpu-proxy", action="store_true", help="skip the CPU-proxy plans")
    parser.add_argument("--out-name", help="results/NAME.md, .json and .png (default: ablation-MODELS)")
    add_target_argument(parser)
    args = parser.parse_args()
    args.out_name = args.out_name or "ablation-" + "-".join(args.models)

    target = planning_target(args.target, budget_gib=args.budget_gib, host_budget_gib=args.host_budget_gib)
    config = jlong.load_config(None, [f"model.preset={args.models[0]}"])
    budget_gib = target.device_budget_gib(config.train.gpu_memory_fraction)
    cpu_proxy = None if args.no_cpu_proxy or target.name == "cpu" else planning_target(
        "cpu", budget_gib=budget_gib, host_budget_gib=args.host_budget_gib)
    started = time.perf_counter()
    all_results = {model: run_model(model, args.lengths, target, cpu_proxy) for model in args.models}
    minutes = (time.perf_counter() - started) / 60
    sections = [
        "# Long-context ablation, planned per device",
        provenance(invocation(__file__), target.compiler())
        + f" {minutes:.0f} minutes in all.",
        __doc__.split("\n\n")[3].replace("\n", " "),
        f"Budgets: {budget_gib:.2f} GiB per device, {args.host_budget_gib:,.0f} GiB of host memory per node "
        "(8 devices); bf16 compute, float32 parameters and AdamW state; `attention.impl=auto` (cuDNN on GPU "
        "targets, the blockwise kernel on the CPU proxy). Host GiB is what `offload_inputs` keeps in pinned "
        "host memory, as the compiler places it. The CPU proxy compiles the same step for virtual CPU devices "
        "(bfloat16 planned as float16, offloaded inputs counted from the policy); its ratio to the GPU "
        "compiler's figure is in brackets.",
    ]
    for model, results in all_results.items():
        states = results[0]["plans"][args.lengths[0]]
        fixed = (states.parameters + states.gradients + states.optimizer_state) / GIB
        sections += [
            f"## {model}",
            f"Parameters, gradients and AdamW state: {fixed:.1f} GiB per device in every row until the optimizer "
            "moves to host memory, before any activation. A longest context of 0 means no length fits.",
            table(results, args.lengths),
        ]
        notes = monotone_notes(results, args.lengths)
        sections.append("Each row lowers the device bytes of the row before."
                        if not notes else "Rows that do not lower the device bytes:\n\n" + "\n".join(f"- {n}" for n in notes))
    sections.append(f"![ablation]({args.out_name}.png)")
    text = "\n\n".join(sections) + "\n"
    RESULTS.mkdir(exist_ok=True)
    chart(all_results, args.lengths, budget_gib, target.name, RESULTS / f"{args.out_name}.png")
    raw = {model: [{"stack": r["name"], "longest": r["maxlen"], "bound_by": r["bound_by"],
                    **{str(n): p.as_dict() for n, p in r["plans"].items()},
                    **{f"cpu_proxy_{n}": p.as_dict() for n, p in r["proxy"].items()}} for r in results]
           for model, results in all_results.items()}
    write_result(f"{args.out_name}.json", json.dumps(raw, indent=1) + "\n")
    print(text)
    print(f"wrote {write_result(f'{args.out_name}.md', text)}, {args.out_name}.png and {args.out_name}.json")


if __name__ == "__main__":
    main()
