"""Where attention runs on the GPU compiler's program, with and without
packed documents and past one node (an estimate, not a measurement).

Llama3-8B on one 8 x H100 node with the default stack
(configs/llama3-8b-5m.yaml's settings) at 131,072 and 1,048,576 tokens,
unpacked and packed (`data.eos_id=0`), and configs/llama3-8b-32m-4nodes.yaml
(Ulysses 8 x ring 4), each compiled for the target and read by `jlong plan`'s
step cost: the share of executed FLOPs in cuDNN attention calls, kernels per
step, the estimated step time and whether the plan fits both budgets.

    python experiments/fused_attention.py [--target h100]

Writes experiments/results/fused-attention.md.
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

PROGRAMS = [
    ("Llama3-8B, one node", "configs/llama3-8b-5m.yaml", [*DEFAULT_STACK, "train.seq_len=131072"]),
    ("Llama3-8B, one node, packed", "configs/llama3-8b-5m.yaml",
     [*DEFAULT_STACK, "train.seq_len=131072", "data.eos_id=0"]),
    ("Llama3-8B, one node", "configs/llama3-8b-5m.yaml", [*DEFAULT_STACK, "train.seq_len=1048576"]),
    ("Llama3-8B, one node, packed", "configs/llama3-8b-5m.yaml",
     [*DEFAULT_STACK, "train.seq_len=1048576", "data.eos_id=0"]),
    ("Llama3-8B, 4 nodes, ring 4 x sp 8", "configs/llama3-8b-32m-4nodes.yaml", []),
    ("Llama3-8B, 4 nodes, ring 4 x sp 8, packed", "configs/llama3-8b-32m-4nodes.yaml", ["data.eos_id=0"]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    headers = ["program", "seq_len", "executed FLOPs in cuDNN attention", "kernels per step", "step s (estimate)",
               "tokens/s per node (estimate)", "device GiB (cuDNN workspace)", "host GiB per node", "fits"]
    rows = []
    for label, path, overrides in PROGRAMS:
        config = jlong.load_config(ROOT / path, overrides)
        planned = plan(config, target)
        memory, cost = planned.memory, planned.cost
        nodes = max(1, config.mesh.size // target.gpus_per_node)
        rows.append([label, f"{config.train.seq_len:,}",
                     f"{cost.flops_by_kind.get('attention', 0) / cost.executed_flops:.0%}", f"{cost.kernels:.2g}",
                     f"{cost.step_time_s:,.1f}", f"{cost.tokens_per_s / nodes:,.0f}",
                     f"{memory.device_total / GIB:.2f} ({memory.cudnn_workspace / GIB:.2f})",
                     f"{memory.host_per_node / GIB:,.0f}", "yes" if memory.fits else "no"])
        print(" | ".join(rows[-1]), flush=True)
    command = invocation(__file__, argv)
    text = "\n\n".join([
        "# Where attention runs: cuDNN on every path",
        provenance(command, target.compiler()),
        estimate_assumptions(target.name) + " A packed cuDNN call is priced as if its sequence were one "
        "document (the compiler cannot see the documents' lengths), so packed rows are upper bounds; a ring "
        "step whose kernel is skipped (no document spans the boundary) is priced as if it ran. Nothing here "
        "ran on a GPU.",
        "Counted from the optimized HLO: cuDNN attention calls are `__cudnn$fmha*` custom calls priced from "
        "their `intermediate_tensor_shape` and mask; every instruction is weighted by its loops' "
        "`known_trip_count`s, and a conditional by its costliest branch.",
        markdown_table(headers, rows),
    ]) + "\n"
    print(f"wrote {write_result('fused-attention.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
