"""What a step costs on the GPU compiler's program (an estimate, not a
measurement): Llama3-8B on one 8 x H100 node at 131,072 ... 8,388,608 tokens
with the default stack (configs/llama3-8b-5m.yaml's settings) and with
`memory.remat=offload_attention`, and the committed configs; published
measured throughputs beside them where they exist.

    python experiments/step_cost.py [--target h100]

Writes experiments/results/step-cost.md.
"""

from __future__ import annotations

import argparse
import sys

import jlong
from common import (
    DEFAULT_STACK,
    GIB,
    ROOT,
    add_target_argument,
    estimate_assumptions,
    invocation,
    markdown_table,
    plan,
    planning_target,
    provenance,
    write_result,
)

DEFAULT_CONFIG = "configs/llama3-8b-5m.yaml"
LENGTHS = [2**17 * 2**k for k in range(7)]  # 131,072 ... 8,388,608
CONFIGS = ["configs/llama3-8b-2m.yaml", "configs/llama3-8b-5m.yaml", "configs/llama3-8b-8m.yaml",
           "configs/qwen3-32b-3m.yaml", "configs/llama3-8b-32m-4nodes.yaml"]

# Measured throughputs published elsewhere, tokens/s per GPU, Llama3-8B on 8 x H100.
# Each is as the issue that asked for this table quotes it; the sources were not read here.
PUBLISHED = {
    131_072: [("UPipe paper (Untied Ulysses), quoted secondhand in issue 23", 2280.0),
              ("torchtitan H100 context-parallel benchmark, FSDP 2 x CP 4, Float8 linears, as quoted in issue 23",
               1071.0)],
    262_144: [("torchtitan H100 context-parallel benchmark, CP 8, Float8 linears, as quoted in issue 23", 548.0)],
}


def measure(path: str, overrides: list[str], target) -> tuple:
    planned = plan(jlong.load_config(ROOT / path, overrides), target)
    return planned.config, planned.memory, planned.cost


def row(label: str, config, memory, cost) -> list:
    per_gpu = cost.tokens_per_s / cost.devices
    bound = " (lower bound: loops of unknown trip count)" if cost.unknown_trip_loops else ""
    return [label, f"{config.train.seq_len:,}", config.memory.remat, f"{memory.device_total / GIB:.1f}",
            f"{memory.host_per_node / GIB:,.0f}", "yes" if memory.fits else "no", f"{cost.step_time_s:,.0f}{bound}",
            f"{per_gpu:,.1f}", f"{cost.mfu:.1%}", f"{cost.recompute_factor:.2f}",
            f"{cost.flops_by_kind.get('attention', 0) / cost.executed_flops:.0%}", f"{cost.kernels:.2g}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    headers = ["config", "seq_len", "remat", "device GiB", "host GiB per node", "fits", "step s (estimate)",
               "tokens/s per GPU (estimate)", "MFU", "executed / model FLOPs", "executed FLOPs in cuDNN attention",
               "kernels"]
    by_length, published_rows = [], []
    for seq_len in LENGTHS:
        for remat in ("offload_inputs", "offload_attention"):
            config, memory, cost = measure(DEFAULT_CONFIG, [*DEFAULT_STACK, f"train.seq_len={seq_len}",
                                                            f"memory.remat={remat}"], target)
            by_length.append(row("default stack", config, memory, cost))
            print(" | ".join(by_length[-1]), flush=True)
            if remat == "offload_inputs":
                for source, figure in PUBLISHED.get(seq_len, []):
                    estimate = cost.tokens_per_s / cost.devices
                    published_rows.append([f"{seq_len:,}", source, f"{figure:,.0f}", f"{estimate:,.1f}",
                                           f"{estimate / figure:.2f}"])
    committed = []
    for path in CONFIGS:
        config, memory, cost = measure(path, [], target)
        committed.append(row(path, config, memory, cost))
        print(" | ".join(committed[-1]), flush=True)
    command = invocation(__file__, argv)
    text = "\n\n".join([
        "# What a step costs: estimates read from the compiled program",
        provenance(command, target.compiler()),
        estimate_assumptions(target.name) + " Tokens/s per GPU: the mesh's tokens per step over the step "
        "time and its devices. Nothing here ran on a GPU.",
        "## Llama3-8B on one 8 x H100 node, by length",
        "The default stack (sp 8, UPipe U = 8, cuDNN, tiled MLP and loss) with layer inputs in host memory "
        "(`offload_inputs`, which recomputes the attention forward pass in the backward pass) and with attention "
        "outputs there too (`offload_attention`). Lengths past the budgets are planned all the same.",
        markdown_table(headers, by_length),
        "## The committed configs",
        "The 32M config's ring steps run in cuDNN (`experiments/fused_attention.py` shows where attention runs); "
        "a conditional (which half of the queries or keys a ring step covers) is priced at its costliest branch.",
        markdown_table(headers, committed),
        "## Published measurements beside the estimate",
        "Llama3-8B, 8 x H100, tokens/s per GPU. The published runs differ from the estimate in stack and kernels "
        "(Float8 linears, their own attention kernels and layouts), so the ratio compares a measurement of one "
        "system with an estimate of another; it is reported as it falls.",
        markdown_table(["seq_len", "source", "published tokens/s per GPU", "jlong estimate, default stack",
                        "estimate / published"], published_rows),
    ]) + "\n"
    print(f"wrote {write_result('step-cost.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
