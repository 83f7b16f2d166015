"""Pinned or pageable host memory for offloaded activations: what XLA:GPU
does with each (deviceless compile for one `--target` GPU; nothing runs).

    python experiments/host_memory_kinds.py [--target h100]

A scan of 16 checkpointed layers offloads each layer's input ([8192, 4096]
bf16, 64 MiB) with jax's offload policy, once to `pinned_host` and once to
`unpinned_host` (pageable memory), and reports the device and host
temporaries XLA:GPU plans for the gradient. Writes
experiments/results/host-memory-kinds.md.
"""

from __future__ import annotations

import argparse
import sys

from common import add_target_argument, invocation, markdown_table, provenance, publish

LAYERS, TOKENS, WIDTH = 16, 8192, 4096


def planned_bytes(target: str, memory_kind: str) -> tuple[int, int]:
    """(device temporaries, host temporaries) of the gradient's compile."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jlong.planner.targets import gpu_devices

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
        offload_src="device", offload_dst=memory_kind,
    )

    def layer(x, w):
        return jnp.tanh(checkpoint_name(x, "layer_input") @ w), None

    def loss(x, ws):
        return jax.lax.scan(jax.checkpoint(layer, policy=policy), x, ws)[0].astype(jnp.float32).sum()

    whole = NamedSharding(Mesh(gpu_devices(target, 1), ("gpu",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((TOKENS, WIDTH), jnp.bfloat16, sharding=whole)
    ws = jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.bfloat16, sharding=whole)
    analysis = jax.jit(jax.grad(loss, argnums=1)).lower(x, ws).compile().memory_analysis()
    return analysis.temp_size_in_bytes, analysis.host_temp_size_in_bytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_target_argument(parser)
    args = parser.parse_args()
    from jlong.planner.targets import PlanTarget, resolve_target, start_planning_backend

    target = PlanTarget(resolve_target(args.target))
    start_planning_backend(cpu_devices=1)
    MIB = 2**20
    rows = []
    for kind in ("pinned_host", "unpinned_host"):
        device, host = planned_bytes(target.name, kind)
        rows.append([f"`{kind}`", f"{device / MIB:,.0f}", f"{host / MIB:,.0f}"])
    text = "\n\n".join([
        "# Offloaded activations: pinned or pageable host memory",
        provenance(invocation(__file__), target.compiler()),
        f"{LAYERS} checkpointed layers, each offloading its {TOKENS} x {WIDTH} bf16 input "
        f"({TOKENS * WIDTH * 2 // MIB} MiB); the gradient's planned temporaries:",
        markdown_table(["offload destination", "device MiB", "host MiB"], rows),
    ]) + "\n"
    return publish("host-memory-kinds.md", text)


if __name__ == "__main__":
    sys.exit(main())
