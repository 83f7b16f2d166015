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
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jlong.config import MeshConfig, ModelConfig  # noqa: E402
from jlong.model.transformer import ForwardOptions, attention_block, layer_param_shapes  # noqa: E402
from jlong.parallel.mesh import ACTIVATION_RULES, make_mesh  # noqa: E402
from jlong.sharding import partition_spec, use_rules  # noqa: E402


def attention_temp_bytes(model: ModelConfig, seq_len: int, sp: int, heads_per_stage: int, dtype="float32") -> int:
    """Compiled temporary bytes per device of the attention block's vjp."""
    mesh = make_mesh(MeshConfig(sp=sp), jax.devices()[:sp])
    options = ForwardOptions(compute_dtype=dtype, attention_impl="blockwise", heads_per_stage=heads_per_stage)
    shapes = {n: s for n, (s, _) in layer_param_shapes(model).items() if n != "mlp_norm" and not n.startswith("w_")}
    replicated = NamedSharding(mesh, P())
    params = {n: jax.ShapeDtypeStruct(s, dtype, sharding=replicated) for n, s in shapes.items()}
    activation = NamedSharding(mesh, partition_spec(("batch", "seq", "embed"), ACTIVATION_RULES))
    x = jax.ShapeDtypeStruct((1, seq_len, model.hidden_size), dtype, sharding=activation)
    positions = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=NamedSharding(mesh, P(None, "sp")))

    def forward_backward(params, x, positions, cotangent):
        with use_rules(mesh, ACTIVATION_RULES):
            block = lambda p, x: attention_block(p, x, positions, None, model, options)  # noqa: E731
            _, pullback = jax.vjp(block, params, x)
            return pullback(cotangent)

    compiled = jax.jit(forward_backward).lower(params, x, positions, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[131072, 262144])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sp", type=int, default=8)
    args = parser.parse_args()
    model = ModelConfig(
        vocab_size=256, hidden_size=args.heads * args.head_dim, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
    )
    stage_sizes = sorted({args.sp, 2 * args.sp, args.heads})
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
