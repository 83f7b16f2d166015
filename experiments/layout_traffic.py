"""Bytes each device sends per layer for the attention exchanges of a
context-parallel layout (Ulysses, ring, or both), counted from the shapes the
stages exchange (`jlong.attention.methods.ulysses.StagePlan`); arithmetic, not a
measurement.

    python experiments/layout_traffic.py [--model llama3-8b] [--seq-len 33554432] [--nodes 4] [--gpus-per-node 8]

Ulysses: per stage, all-to-all of q and o ([s, U, d] each) and of k and v in
the stage's kv slots ([s, C x r, d] each); a device keeps 1/C of what it
exchanges. Ring: per stage, k and v of the ring chunk ([S/R, r, d] each) pass
to the next device R - 1 times in the forward pass; in the backward pass R
times, with their float32 gradients. bf16 activations. Writes
experiments/results/layout-traffic.md.
"""

from __future__ import annotations

import argparse
import sys

from common import GIB, invocation, markdown_table, provenance, publish

from jlong.attention.methods.ulysses import StagePlan
from jlong.config import load_config

BF16, F32 = 2, 4


def traffic(model, seq_len: int, ring: int, sp: int, heads_per_stage: int) -> dict[str, float]:
    """GiB sent per device per layer: Ulysses forward and backward, ring forward and backward."""
    H, d = model.num_attention_heads, model.dim_per_head
    plan = StagePlan(H, model.kv_heads, sp, heads_per_stage)
    s = seq_len // (ring * sp)  # this device's tokens
    kept = 1 / sp
    slots = sp * plan.kv_per_device  # kv slots a stage exchanges
    ulysses = plan.num_stages * (2 * s * heads_per_stage * d + 2 * s * slots * d) * BF16 * (1 - kept)
    ring_chunk_kv = 2 * (seq_len // ring) * plan.kv_per_device * d  # k and v of the chunk, one device's slots
    steps = ring if ring > 1 else 0  # no ring, no passing
    ring_forward = plan.num_stages * max(steps - 1, 0) * ring_chunk_kv * BF16
    ring_backward = plan.num_stages * steps * ring_chunk_kv * (BF16 + F32)
    return {
        "Ulysses forward": ulysses / GIB,
        "Ulysses backward": ulysses / GIB,  # the same exchanges, transposed
        "ring forward": ring_forward / GIB,
        "ring backward": ring_backward / GIB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--seq-len", type=int, default=32 * 2**20)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    args = parser.parse_args()
    model = load_config(None, [f"model.preset={args.model}"]).model
    devices = args.nodes * args.gpus_per_node
    H = model.num_attention_heads
    layouts = []
    for ring in sorted({1, args.nodes, devices}):
        sp = devices // ring
        if H % sp:
            continue
        for U in sorted({sp, H}):
            layouts.append((ring, sp, U))
    rows = []
    for ring, sp, U in layouts:
        t = traffic(model, args.seq_len, ring, sp, U)
        inter_node = "ring" if sp <= args.gpus_per_node else "Ulysses and ring" if ring > 1 else "Ulysses"
        rows.append([f"ring {ring} x sp {sp}", U, *(f"{v:,.1f}" for v in t.values()), inter_node])
    text = "\n\n".join([
        f"# Attention traffic per layer: {args.model} at {args.seq_len:,} tokens on {args.nodes} x "
        f"{args.gpus_per_node} GPUs",
        provenance(invocation(__file__), "nothing compiled: Python arithmetic",
                   "counted from the exchanged shapes, not measured") + " GiB each device sends per layer.",
        markdown_table(["layout", "U", "Ulysses all-to-all, forward", "Ulysses all-to-all, backward",
                        "ring, forward", "ring, backward", "crosses nodes"], rows),
    ]) + "\n"
    return publish("layout-traffic.md", text)


if __name__ == "__main__":
    sys.exit(main())
