"""What multi-head latent attention's ring sends, read from the compiled
training step: the latent (c and the rotary key per token) against the
up-projected heads' keys and values, both ways for the same layout.

    python experiments/latent_traffic.py [--model glm-4.7-flash] [--seq-len 1048576] [--layouts ring8-sp1 ...]

Each layout (ringR-spC, heads per stage U = every head by default) compiles
twice for the target (XLA:GPU, deviceless): as jlong runs it, moving the
latent where it is narrower (`LatentProjection.moves_latent`), and with
that answer forced to "no", moving the heads' keys and values as every
other attention does. The figures are the step's collective bytes per
device as the planner reads them from the compiled program
(`jlong.planner.step_cost`): collective-permute is the ring's; beside them
the step's executed FLOPs (every arriving chunk's up-projection counted) and
its estimated time. Writes experiments/results/latent-traffic.md.
"""

from __future__ import annotations

import argparse
import re
import sys
from unittest import mock

from common import (add_target_argument, estimate_assumptions, invocation, markdown_table, planning_target,
                    provenance, publish)

from jlong.attention.latent import LatentProjection
from jlong.config import load_config
from jlong.planner.memory import compile_train_step
from jlong.planner.step_cost import step_cost

GIB = 2**30
NOT_BYTES = ("unknown trip loops", "flops", "step time")


def layout_overrides(layout: str, heads: int) -> list[str]:
    """ringR-spC[-uU] -> mesh and stage overrides."""
    match = re.fullmatch(r"ring(\d+)-sp(\d+)(?:-u(\d+))?", layout)
    if not match:
        raise SystemExit(f"--layouts takes ringR-spC or ringR-spC-uU, got {layout!r}")
    ring, sp, stage = match.groups()
    return [f"mesh.ring={ring}", f"mesh.sp={sp}", f"attention.heads_per_stage={stage or heads}"]


def collectives(config, target, *, latent: bool) -> dict[str, float]:
    """Bytes per device per step by collective kind (links summed), loops of unknown trip count, and the
    step's executed FLOPs per device and estimated time (the up-projection of every arriving chunk included)."""
    if latent:
        step = compile_train_step(config, target)
    else:
        with mock.patch.object(LatentProjection, "moves_latent", lambda self, p, heads: False):
            step = compile_train_step(config, target)
    cost = step_cost(step)
    by_kind: dict[str, float] = {}
    for kind_link, value in cost.collective_bytes_by_kind.items():
        kind = kind_link.rsplit(" ", 1)[0]
        by_kind[kind] = by_kind.get(kind, 0.0) + value
    return {**by_kind, "unknown trip loops": cost.unknown_trip_loops, "flops": cost.executed_flops,
            "step time": cost.step_time_s}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="glm-4.7-flash")
    parser.add_argument("--seq-len", type=int, default=2**20)
    parser.add_argument("--layouts", nargs="+", default=["ring8-sp1", "ring2-sp4"])
    add_target_argument(parser)
    args = parser.parse_args()
    target = planning_target(args.target)
    tile = min(8192, args.seq_len // 8)  # tokens a tile of the MLP and the loss takes, on 8 devices
    base = [f"model.preset={args.model}", f"train.seq_len={args.seq_len}", "train.batch_size=1",
            "train.compute_dtype=bfloat16", f"memory.mlp_tile={tile}", f"memory.loss_tile={tile}"]
    model = load_config(None, base).model
    rows, ratios = [], []
    for layout in args.layouts:
        config = load_config(None, [*base, *layout_overrides(layout, model.num_attention_heads)])
        U, sp = config.attention.heads_per_stage, config.mesh.sp
        moved = {way: collectives(config, target, latent=way == "latent") for way in ("latent", "heads")}
        for way, figures in moved.items():
            print(layout, way, figures, file=sys.stderr, flush=True)
        ring_bytes = {way: figures.get("collective-permute", 0.0) for way, figures in moved.items()}
        ratio = ring_bytes["heads"] / ring_bytes["latent"]
        ratios.append(f"{layout}: {ratio:.1f}x")
        for way, figures in moved.items():
            others = ", ".join(f"{kind} {value / GIB:,.2f}" for kind, value in sorted(figures.items())
                               if kind not in ("collective-permute", *NOT_BYTES) and value)
            rows.append([f"ring {config.mesh.ring} x sp {sp}, U = {U}", way,
                         f"{ring_bytes[way] / GIB:,.2f}", others or "none", f"{figures['flops']:.4g}",
                         f"{figures['step time']:,.1f}", figures["unknown trip loops"]])
    latent_width = model.kv_lora_rank + model.qk_rope_head_dim
    head_width = model.head_dim + model.v_head_dim
    text = "\n\n".join([
        f"# Multi-head latent attention's ring traffic: {args.model} at {args.seq_len:,} tokens",
        provenance(invocation(__file__), f"XLA:GPU for {target.name}, deviceless",
                   "collective bytes per device per training step, read by the planner from the compiled "
                   "program") + (f" The latent is {latent_width} values per token (kv_lora_rank + "
                                 f"qk_rope_head_dim); one head's key and value {head_width}; a device receives "
                                 "U / sp heads per stage. \"heads\" forces `LatentProjection.moves_latent` to "
                                 "False (the up-projected keys and values travel, as before)."),
        markdown_table(["layout", "moves", "collective-permute (the ring), GiB", "other collectives, GiB",
                        "executed FLOPs per device", "est. step time, s", "loops of unknown trip count"], rows),
        estimate_assumptions(target.name),
        "Ring traffic, heads over latent: " + "; ".join(ratios) + ".",
    ]) + "\n"
    return publish("latent-traffic.md", text)


if __name__ == "__main__":
    sys.exit(main())
