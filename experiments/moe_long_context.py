"""Mixtures of experts at long context, planned: Qwen3-30B-A3B at 1M tokens
on one 8xH100 node with configs/qwen3-30b-a3b-1m.yaml beside TRL's reported
measurement on the same node, the dense Qwen3-8B and Qwen3-32B that TRL
measured beside it (planned with the planner's own memory choice), the
longest Qwen3-30B-A3B context on one node (configs/qwen3-30b-a3b-9m.yaml),
and Qwen3.5-122B-A10B on four nodes at 1M.

    python experiments/moe_long_context.py [--target h100] [--skip-dense] [--skip-122b]

Writes experiments/results/moe-long-context.md. Every jlong time is an
estimate read from a compiled program (deviceless XLA:GPU), never a
measurement; TRL's are measurements of another system, as reported.
"""

from __future__ import annotations

import argparse
import sys

import jlong
from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, markdown_table, per_gpu, \
    plan, planning_target, provenance, timed, write_result

CONFIGS = ROOT / "configs"
# TRL with transformers' context parallelism, one 8xH100 node, 1,048,576 tokens (reported August 2026): seconds a
# step, and peak GB per GPU where reported.
TRL = {"qwen3-30b-a3b": (483, 46), "qwen3-8b": (373, None), "qwen3-32b": (1295, None)}
AUTO = ["memory.remat=auto", "memory.remat_runs={}", "attention.heads_per_stage=auto"]
# Qwen3.5-122B-A10B on 4 nodes: ring 4 across them, Ulysses 8 within each; configs/qwen3-30b-a3b-9m.yaml's
# memory settings.
FOUR_NODES = ["model.preset=qwen3.5-122b-a10b", "mesh.ring=4", "train.seq_len=1048576"]


def row(name: str, result, seconds: float, trl: tuple | None = None) -> list:
    cost, config = result.cost, result.config
    measured = f"{trl[0]:,}" if trl else ""
    ratio = f"{trl[0] / cost.step_time_s:.2f}" if trl else ""
    return [name, f"{config.mesh.size}", f"{config.train.seq_len:,}", "yes" if result.fits else "no",
            f"{cost.step_time_s:,.0f}", measured, ratio, f"{per_gpu(result):,.1f}", f"{cost.mfu:.3f}",
            f"{cost.executed_flops / cost.model_flops:.2f}", f"{result.device_bytes / GIB:.2f}",
            f"{result.host_bytes_per_node / GIB:,.0f}", f"{seconds:.0f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--skip-dense", action="store_true", help="leave out Qwen3-8B and Qwen3-32B")
    parser.add_argument("--skip-122b", action="store_true", help="leave out Qwen3.5-122B-A10B on four nodes")
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows, notes = [], []
    moe, seconds = timed(plan, jlong.load_config(CONFIGS / "qwen3-30b-a3b-1m.yaml"), target)
    rows.append(row("Qwen3-30B-A3B (configs/qwen3-30b-a3b-1m.yaml)", moe, seconds, TRL["qwen3-30b-a3b"]))
    notes.append(f"Qwen3-30B-A3B at 1,048,576 tokens: est. {moe.cost.step_time_s:,.0f} s a step against TRL's "
                 f"measured 483 s ({483 / moe.cost.step_time_s:.2f}x), {moe.device_bytes / GIB:.1f} GiB per device "
                 f"planned against TRL's 46 GB peak; its layers: {', '.join(moe.decisions) or 'as configured'}.")
    if not args.skip_dense:
        for preset in ("qwen3-8b", "qwen3-32b"):
            config = jlong.load_config(CONFIGS / "qwen3-30b-a3b-1m.yaml", [f"model.preset={preset}", *AUTO])
            dense, seconds = timed(plan, config, target)
            rows.append(row(f"{preset.replace('qwen', 'Qwen').upper().replace('QWEN', 'Qwen')} (memory.remat=auto)",
                            dense, seconds, TRL[preset]))
    longest, seconds = timed(plan, jlong.load_config(CONFIGS / "qwen3-30b-a3b-9m.yaml"), target)
    rows.append(row("Qwen3-30B-A3B (configs/qwen3-30b-a3b-9m.yaml)", longest, seconds))
    if not args.skip_122b:
        config = jlong.load_config(CONFIGS / "qwen3-30b-a3b-9m.yaml", FOUR_NODES)
        big, seconds = timed(plan, config, target)
        rows.append(row("Qwen3.5-122B-A10B, 4 nodes (ring 4 x sp 8, the 9m config's memory settings)", big,
                        seconds))
        shares = big.cost.time_by_kind
        largest = max(shares, key=shares.get)
        notes.append(f"Qwen3.5-122B-A10B on 32 H100s at 1,048,576 tokens: {'fits' if big.fits else 'does not fit'} "
                     f"({big.device_bytes / GIB:.1f} GiB per device, {big.host_bytes_per_node / GIB:,.0f} GiB host "
                     f"per node), est. {big.cost.step_time_s:,.0f} s a step, MFU {big.cost.mfu:.3f}; the largest "
                     f"share of the estimate is {largest} ({shares[largest] / sum(shares.values()):.0%}), "
                     f"{big.cost.kernels:,.0f} kernel launches: 32,768 tokens per device are few for the Gated "
                     "DeltaNet chunk loops, which the ring runs again with the state from the ranks before.")
    headers = ["model", "GPUs", "seq_len", "fits", "est. step s", "TRL measured s", "TRL / est.",
               "est. tokens/s per GPU", "est. MFU", "exec/model", "GiB per device", "host GiB per node",
               "planning s"]
    text = "\n\n".join([
        "# Mixtures of experts at long context",
        provenance(invocation(__file__, argv), target.compiler()),
        estimate_assumptions(target.name) + " Model FLOPs (MFU) count each token's routed experts only "
        "(num_experts_per_tok of num_experts) and the router (`Family.matmul_params_per_token`); the grouped "
        "matmul kernel's calls are priced at the routed rows' FLOPs.",
        "TRL's column: TRL with transformers' context parallelism on one 8 x H100 node at 1,048,576 tokens, "
        "as reported in August 2026 (a measurement of another system: each ratio sets it against a jlong "
        "estimate, reported as it falls). The dense rows use the planner's memory choice within the default "
        "budgets (`memory.remat=auto`, `attention.heads_per_stage=auto`) on the 1m config's mesh.",
        markdown_table(headers, rows),
        *notes,
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('moe-long-context.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
