"""Gemma 3 at long context beside Llama3-8B, planned: Gemma-3-12B at 1M on one
8 x H100 node (configs/gemma3-12b-1m.yaml) against Llama3-8B at 1M with the
committed 5M config's settings, and the longest Gemma-3-27B context on one
node (Ulysses over 8) and on four (Ulysses 8 x ring 4), each beside
Llama3-8B's estimated step at the same length and mesh.

    python experiments/gemma3_context.py [--target h100] [--parts 12b-1m 27b-1node 27b-4nodes]

Writes experiments/results/gemma3-context.md. Every time is an estimate read
from a compiled program (deviceless XLA:GPU), never a measurement.
"""

from __future__ import annotations

import argparse
import sys

import jlong
from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, longest, markdown_table, per_gpu, \
    plan, planning_target, provenance, timed, write_result

LLAMA = ROOT / "configs" / "llama3-8b-5m.yaml"
GEMMA_12B = ROOT / "configs" / "gemma3-12b-1m.yaml"
# Gemma-3-27B on the 12B config's stack; on one node its optimizer states go to host memory (27B parameters'
# float32 masters and AdamW moments are 40 GiB per GPU over 8), four nodes add a ring of 4 across them
# (Ulysses inside each node).
MESHES = {"27b-1node": ["mesh.sp=8", "memory.optimizer_offload=true"], "27b-4nodes": ["mesh.sp=8", "mesh.ring=4"]}


def row(name: str, result, seconds: float) -> list:
    cost, config = result.cost, result.config
    return [name, f"{config.train.seq_len:,}", f"{config.mesh.size}", "yes" if result.fits else "no",
            f"{cost.step_time_s:,.1f}", f"{per_gpu(result):,.1f}", f"{cost.mfu:.3f}",
            f"{cost.recompute_factor:.2f}", f"{result.device_bytes / GIB:.2f}",
            f"{result.host_bytes_per_node / GIB:,.0f}", f"{seconds:.0f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--parts", nargs="+", default=["12b-1m", *MESHES], choices=["12b-1m", *MESHES])
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows, notes = [], []
    if "12b-1m" in args.parts:
        gemma, seconds = timed(plan, jlong.load_config(GEMMA_12B), target)
        rows.append(row("Gemma-3-12B (configs/gemma3-12b-1m.yaml)", gemma, seconds))
        llama, seconds = timed(plan, jlong.load_config(LLAMA, ["train.seq_len=1048576"]), target)
        rows.append(row("Llama3-8B (5M config's settings)", llama, seconds))
        notes.append(f"Gemma-3-12B / Llama3-8B at 1M, tokens/s per GPU: {per_gpu(gemma) / per_gpu(llama):.2f}x.")
    for part in (p for p in args.parts if p in MESHES):
        mesh = MESHES[part]
        gemma_config = jlong.load_config(GEMMA_12B, ["model.preset=gemma3-27b", *mesh])
        found, seconds = timed(longest, gemma_config, target)
        at = [f"train.seq_len={found.seq_len}"]
        gemma, plan_seconds = timed(plan, jlong.load_config(GEMMA_12B, ["model.preset=gemma3-27b", *mesh, *at]),
                                    target)
        rows.append(row(f"Gemma-3-27B longest ({part}; maxlen {seconds:.0f} s)", gemma, plan_seconds))
        llama, seconds = timed(plan, jlong.load_config(LLAMA, [*mesh, *at, "memory.optimizer_offload=false"]), target)
        rows.append(row(f"Llama3-8B at that length ({part})", llama, seconds))
        notes.append(f"{part}: the longest Gemma-3-27B context is {found.seq_len:,} tokens ({found.bound_by} "
                     f"budget binds, {len(found.probes)} plans); Gemma-3-27B / Llama3-8B there, tokens/s per GPU: "
                     f"{per_gpu(gemma) / per_gpu(llama):.2f}x.")
    headers = ["model", "seq_len", "GPUs", "fits", "est. step s", "est. tokens/s per GPU", "est. MFU",
               "exec/model", "GiB per device", "host GiB per node", "planning s"]
    command = invocation(__file__, argv)
    text = "\n\n".join([
        "# Gemma 3 at long context beside Llama3-8B",
        provenance(command, target.compiler()),
        estimate_assumptions(target.name) + " Model FLOPs (MFU) count what each layer's window computes "
        "(`Family.flops_per_token`); cuDNN's windowed calls are priced by the visible fraction of their band.",
        "Every run uses `memory.remat=auto` and `attention.heads_per_stage=auto` (the planner's choice within "
        "the default budgets); Gemma-3-27B runs on configs/gemma3-12b-1m.yaml's stack with its own preset "
        "(on one node with its optimizer states in host memory), Llama3-8B on configs/llama3-8b-5m.yaml's, "
        "on the same mesh.",
        markdown_table(headers, rows),
        *notes,
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('gemma3-context.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
