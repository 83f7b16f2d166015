"""What each memory technique saves, from XLA's compiled memory analysis for
8 devices of `--target` (compile-only H100s by default; nothing is allocated):

1. single blocks at long context (llama3.2-1b shapes, 128K vocabulary,
   float32): the loss and the MLP, whole and in sequence tiles;
2. the whole train step of Llama3-8B on sp=8 under each remat policy, then
   with the tiled MLP and loss added: per-device GiB, and what goes to host.

    python experiments/memory_stack.py [--target h100] [--seq 131072] [--step-seq 1048576]

Writes experiments/results/memory_stack.md.
"""

from __future__ import annotations

import argparse

import jlong
from block_probe import loss_temp_bytes, mlp_temp_bytes
from common import GIB, add_target_argument, invocation, markdown_table, plan, planning_target, provenance, write_result

MIB = 2**20


def block_rows(model: jlong.ModelConfig, seq: int, target) -> list[list]:
    rows, devices = [], target.devices(8)
    for name, probe in (("loss (output projection + cross-entropy)", loss_temp_bytes), ("MLP (norm + SwiGLU)", mlp_temp_bytes)):
        untiled = probe(model, seq, 8, 0, devices=devices)
        for tile in (1024, 256):
            tiled = probe(model, seq, 8, tile, devices=devices)
            rows.append([name, f"{untiled / MIB:,.0f}", tile, f"{tiled / MIB:,.0f}", f"{tiled / untiled:.3f}"])
    return rows


STEP_ROWS = [
    ("remat none", ["memory.remat=none"]),
    ("remat full", ["memory.remat=full"]),
    ("remat save_inputs", ["memory.remat=save_inputs"]),
    ("remat save_attention", ["memory.remat=save_attention"]),
    ("remat offload_inputs", ["memory.remat=offload_inputs"]),
    ("offload_inputs + mlp_tile 2048", ["memory.remat=offload_inputs", "memory.mlp_tile=2048"]),
    ("offload_inputs + mlp_tile 2048 + loss_tile 1024",
     ["memory.remat=offload_inputs", "memory.mlp_tile=2048", "memory.loss_tile=1024"]),
]


def step_rows(seq: int, target) -> list[list]:
    base = ["model.preset=llama3-8b", "mesh.sp=8", "train.batch_size=1", f"train.seq_len={seq}",
            "attention.impl=auto", "attention.block_size=1024"]
    rows = []
    for name, overrides in STEP_ROWS:
        result = plan(jlong.load_config(None, [*base, *overrides]), target).memory
        on_device = 0 if result.host_offload else result.saved_layer_inputs
        rows.append([name, *(f"{value / GIB:.2f}" for value in (
            result.temporaries, on_device, result.device_total, result.host_offload))])
        print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072, help="sequence length of the block probes")
    parser.add_argument("--step-seq", type=int, default=1048576, help="sequence length of the whole-step plans")
    add_target_argument(parser)
    args = parser.parse_args()

    target = planning_target(args.target)
    model = jlong.load_config(None, ["model.preset=llama3.2-1b"]).model
    blocks = block_rows(model, args.seq, target)
    steps = step_rows(args.step_seq, target)
    text = "\n\n".join([
        "# Memory stack: what each technique saves",
        provenance(invocation(__file__), target.compiler()),
        f"## Single blocks, forward + backward: llama3.2-1b shapes, S = {args.seq:,}, sp = 8, float32",
        "Per-device temporary MiB of the block's forward and backward pass.",
        markdown_table(["block", "untiled MiB", "tile", "tiled MiB", "tiled / untiled"], blocks),
        f"## Whole train step: Llama3-8B, S = {args.step_seq:,}, sp = 8 (FSDP over all 8), bf16 compute",
        "GiB per device. The layer inputs column is what the remat policy keeps on the device; "
        "host is what `offload_inputs` moves to pinned host memory (as XLA:GPU places it; on the cpu "
        "target, where the offload compiles to nothing, counted from the shapes). `attention.impl=auto`: "
        "cuDNN on GPU targets, the blockwise kernel on CPU.",
        markdown_table(["setting", "temporaries", "of which layer inputs", "device total", "host"], steps),
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('memory_stack.md', text)}")


if __name__ == "__main__":
    main()
