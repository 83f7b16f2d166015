"""Qwen3.5 (Gated DeltaNet hybrids) at long context beside dense models,
planned: Qwen3.5-27B with configs/qwen3.5-27b-3m.yaml at each length, beside
Qwen3-32B with configs/qwen3-32b-3m.yaml's settings and Llama3-8B with
configs/llama3-8b-5m.yaml's settings at the same length on the same node,
and optionally Qwen3.5-9B's longest context on one node.

    python experiments/hybrid_throughput.py [--target h100] [--seq-lens 3145728 ...] [--longest-9b]

Writes experiments/results/hybrid-throughput.md. Every time is an estimate
read from a compiled program (deviceless XLA:GPU), never a measurement.
"""

from __future__ import annotations

import argparse
import sys

import jlong
from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, longest, markdown_table, per_gpu, \
    plan, planning_target, provenance, timed, write_result

QWEN3_5 = ROOT / "configs" / "qwen3.5-27b-3m.yaml"
DENSE = {"Qwen3-32B (qwen3-32b-3m.yaml's settings)": ROOT / "configs" / "qwen3-32b-3m.yaml",
         "Llama3-8B (llama3-8b-5m.yaml's settings)": ROOT / "configs" / "llama3-8b-5m.yaml"}


def row(name: str, result, seconds: float) -> list:
    cost, config = result.cost, result.config
    return [name, f"{config.train.seq_len:,}", "yes" if result.fits else "no", f"{cost.step_time_s:,.0f}",
            f"{per_gpu(result):,.1f}", f"{cost.mfu:.3f}", f"{cost.recompute_factor:.2f}",
            f"{result.device_bytes / GIB:.2f}", f"{result.host_bytes_per_node / GIB:,.0f}", f"{seconds:.0f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[3 * 2**20])
    parser.add_argument("--longest-9b", action="store_true", help="also search Qwen3.5-9B's longest context")
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows, notes = [], []
    for seq_len in args.seq_lens:
        at = [f"train.seq_len={seq_len}"]
        hybrid, seconds = timed(plan, jlong.load_config(QWEN3_5, at), target)
        rows.append(row("Qwen3.5-27B (configs/qwen3.5-27b-3m.yaml)", hybrid, seconds))
        for name, path in DENSE.items():
            dense, seconds = timed(plan, jlong.load_config(path, at), target)
            rows.append(row(name, dense, seconds))
            notes.append(f"At {seq_len:,} tokens, Qwen3.5-27B / {name.split(' ')[0]}, estimated tokens/s per GPU: "
                         f"{per_gpu(hybrid) / per_gpu(dense):.2f}x.")
    if args.longest_9b:
        config = jlong.load_config(QWEN3_5, ["model.preset=qwen3.5-9b"])
        found, seconds = timed(longest, config, target)
        nine, plan_seconds = timed(plan, jlong.load_config(QWEN3_5, ["model.preset=qwen3.5-9b",
                                                                     f"train.seq_len={found.seq_len}"]), target)
        rows.append(row(f"Qwen3.5-9B longest (maxlen {seconds:.0f} s)", nine, plan_seconds))
        notes.append(f"The longest Qwen3.5-9B context on one node with the 27B config's settings: "
                     f"{found.seq_len:,} tokens ({found.bound_by} budget binds, {len(found.probes)} plans).")
    headers = ["model", "seq_len", "fits", "est. step s", "est. tokens/s per GPU", "est. MFU", "exec/model",
               "GiB per device", "host GiB per node", "planning s"]
    text = "\n\n".join([
        "# Qwen3.5 (Gated DeltaNet hybrid) at long context beside dense models",
        provenance(invocation(__file__, argv), target.compiler()),
        estimate_assumptions(target.name) + " Model FLOPs (MFU) count each layer type's work "
        "(`Family.flops_per_token`: the Gated DeltaNet layers' chunked rule, linear in the length; the attention "
        "layers' causal attention).",
        "All on one 8 x H100 node, Ulysses over the 8 GPUs, each model with its committed config's memory "
        "settings (Qwen3.5-27B and Qwen3-32B: optimizer states in host memory, one layer input per two layers "
        "in host memory).",
        markdown_table(headers, rows),
        *notes,
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('hybrid-throughput.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
