"""Per-device temporary bytes of one attention block's forward + backward,
UPipe (U = sp) against plain Ulysses (U = all heads), from XLA's compiled
memory analysis on 8 virtual CPU devices (nothing is allocated).

    python experiments/upipe_memory.py [--seq 131072 262144] [--heads 32] [--kv-heads 8]

float32 throughout: the CPU compiler turns bfloat16 matmuls into float32
ones with converted copies of their operands, which would blur the picture.
The block is the whole attention block (q/k/v projections, exchanges,
attention, output projection), so the figures include terms that do not
depend on U: the saved attention output and the [B, S/sp, D] gradient of
the block's input.
"""

from __future__ import annotations

import argparse

import jlong
from block_probe import attention_temp_bytes
from common import start_cpu_devices


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sp", type=int, default=8)
    args = parser.parse_args()
    start_cpu_devices(args.sp)
    model = jlong.ModelConfig(
        vocab_size=256, hidden_size=args.heads * args.head_dim, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
    )
    # U must be a multiple of sp that divides the heads.
    stage_sizes = sorted({u for u in (args.sp, 2 * args.sp, args.heads) if args.heads % u == 0 and u % args.sp == 0})
    if args.sp not in stage_sizes:
        parser.error(f"--heads {args.heads} is not a multiple of --sp {args.sp}")
    print(f"{args.heads} heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, sp={args.sp}, float32, "
          "attention block forward+backward, temp MiB per device")
    print("seq_len  " + "  ".join(f"U={u:<6}" for u in stage_sizes) + "  U=sp / U=H")
    previous = None
    for seq in args.seq:
        temps = {u: attention_temp_bytes(model, seq, args.sp, u) for u in stage_sizes}
        ratio = temps[args.sp] / temps[args.heads]
        growth = "" if previous is None else f"   x{temps[args.sp] / previous:.3f} vs previous S (U=sp)"
        print(f"{seq:<8} " + "  ".join(f"{temps[u] / 2**20:<8.1f}" for u in stage_sizes) + f"  {ratio:.3f}{growth}")
        previous = temps[args.sp]


if __name__ == "__main__":
    main()
