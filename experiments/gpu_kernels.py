"""Checks the kernels of Qwen3.5's layers on one GPU: the grouped matmul of
routed experts and the chunked gated delta rule of Gated DeltaNet.

Both are tested on the CPU (the Triton kernels in Pallas' interpret mode,
the chunked rule against the rule token by token) and compile deviceless for
H100s; what Triton and XLA:GPU compute from them can only be seen on a GPU.
Each output's worst error against a float32 reference, beside a yardstick:

- grouped matmul (`jlong.moe.grouped_matmul_triton`), bf16, forward and
  both gradients, groups of uneven sizes (empty ones, ones that share a
  tile): the reference is XLA's `ragged_dot` in float32 at the highest
  precision, the yardstick `ragged_dot` in bf16;
- gated delta rule, `chunked` as a training step runs it (q, k, v in
  bf16, decays and write strengths in float32, the default matmul
  precision), output, final state and every input's gradient, packed
  documents and grouped key heads: the reference is the rule token by token
  (`recurrent`) in float32 at the highest precision, the yardstick the same
  reference given q, k and v rounded to bf16 (the error their precision
  alone makes).

    python experiments/gpu_kernels.py

Under a minute on one H100. Exits 1 if any error exceeds twice the yardstick
(plus 1e-3 of the output's scale), 2 without a GPU; `gpu_truth.py` runs the
same checks as one of its parts.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jlong.linear_attention import gated_delta
from jlong.moe import grouped_matmul_triton


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"gpu_kernels needs a GPU; this backend is {jax.default_backend()}", file=sys.stderr)
        return 2
    rows = check_all()
    for row in rows:
        print(f"{row['kernel']:>16} {row['output']:>6}: error {row['error']:.3e}  yardstick {row['yardstick']:.3e}"
              f"  {'ok' if row['ok'] else 'TOO FAR'}")
    failed = [row for row in rows if not row["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} outputs within bounds")
    return 1 if failed else 0


def check_all(*, small: bool = False) -> list[dict]:
    """Every check's rows; `small` shapes (and Pallas' interpret mode) for a CPU rehearsal."""
    interpret = jax.default_backend() != "gpu"
    if small:
        return (grouped_matmul_rows(rows=200, k=64, n=32, groups=6, interpret=interpret)
                + gated_delta_rows(seq_len=256, heads=4, key_heads=2, head_dim=16, documents=3))
    return (grouped_matmul_rows(rows=4096, k=512, n=256, groups=16, interpret=interpret)
            + gated_delta_rows(seq_len=2048, heads=8, key_heads=4, head_dim=128, documents=5))


def _row(kernel: str, output: str, got, exact, rounded) -> dict:
    got, exact, rounded = (np.asarray(x, np.float64) for x in (got, exact, rounded))
    scale = float(np.abs(exact).max())
    error, yardstick = float(np.abs(got - exact).max()), float(np.abs(rounded - exact).max())
    return {"kernel": kernel, "output": output, "error": error, "yardstick": yardstick, "scale": scale,
            "ok": error <= 2 * yardstick + 1e-3 * scale}


def uneven_group_sizes(rows: int, groups: int, seed: int = 0) -> np.ndarray:
    """Sizes summing to `rows`, skewed as routing is: some groups empty, most not multiples of a tile."""
    rng = np.random.default_rng(seed)
    weights = rng.gamma(0.6, size=groups)
    weights[rng.choice(groups, max(1, groups // 5), replace=False)] = 0.0
    sizes = np.floor(weights / weights.sum() * rows).astype(np.int32)
    sizes[np.argmax(sizes)] += rows - sizes.sum()
    return sizes


def grouped_matmul_rows(*, rows: int, k: int, n: int, groups: int, interpret: bool) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.float32)
    w = jax.random.normal(keys[1], (groups, k, n), jnp.float32) / np.sqrt(k)
    dy = jax.random.normal(keys[2], (rows, n), jnp.float32)
    sizes = jnp.asarray(uneven_group_sizes(rows, groups))
    bf16 = [t.astype(jnp.bfloat16) for t in (x, w, dy)]

    def outputs(product, x, w, dy):
        y, pullback = jax.vjp(lambda x, w: product(x, w, sizes), x, w)
        return (y, *pullback(dy))

    with jax.default_matmul_precision("highest"):
        exact = jax.jit(lambda *a: outputs(jax.lax.ragged_dot, *a))(x, w, dy)
    triton = jax.jit(lambda *a: outputs(
        lambda x, w, s: grouped_matmul_triton.grouped_matmul(x, w, s, interpret=interpret), *a))(*bf16)
    xla_bf16 = jax.jit(lambda *a: outputs(jax.lax.ragged_dot, *a))(*bf16)
    return [_row("grouped matmul", name, got, e, r)
            for name, got, e, r in zip(("y", "dx", "dw"), triton, exact, xla_bf16)]


def gated_delta_inputs(seq_len: int, heads: int, key_heads: int, head_dim: int, documents: int):
    """Inputs shaped as Gated DeltaNet makes them: unit-norm queries and keys, log decays below zero,
    write strengths in (0, 1), `documents` packed documents; and a cotangent for each output."""
    keys = jax.random.split(jax.random.key(1), 7)
    shape = (1, seq_len)

    def unit(key, h):
        t = jax.random.normal(key, (*shape, h, head_dim), jnp.float32)
        return t / jnp.linalg.norm(t, axis=-1, keepdims=True)

    q, k = unit(keys[0], key_heads) / np.sqrt(head_dim), unit(keys[1], key_heads)  # as the layer scales q
    v = jax.random.normal(keys[2], (*shape, heads, head_dim), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(keys[3], (*shape, heads)) - 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (*shape, heads)))
    rng = np.random.default_rng(1)
    starts = np.isin(np.arange(seq_len), rng.choice(np.arange(1, seq_len), documents - 1, replace=False))
    segments = jnp.asarray(np.cumsum(starts)[None], jnp.int32)
    do = jax.random.normal(keys[5], v.shape, jnp.float32)
    dstate = jax.random.normal(keys[6], (1, heads, head_dim, head_dim), jnp.float32)
    return (q, k, v, g, beta), segments, (do, dstate)


GATED_DELTA_OUTPUTS = ("o", "state", "dq", "dk", "dv", "dg", "dbeta")


def gated_delta_rows(*, seq_len: int, heads: int, key_heads: int, head_dim: int, documents: int) -> list[dict]:
    inputs, segments, cotangents = gated_delta_inputs(seq_len, heads, key_heads, head_dim, documents)

    def outputs(rule, inputs):
        (o, state), pullback = jax.vjp(lambda *a: rule(*a, segment_ids=segments), *inputs)
        grads = pullback((cotangents[0].astype(o.dtype), cotangents[1]))
        return (o, state, *grads)

    rounded = tuple(t.astype(jnp.bfloat16) for t in inputs[:3]) + inputs[3:]  # the layer's dtypes
    with jax.default_matmul_precision("highest"):
        exact = jax.jit(lambda a: outputs(gated_delta.recurrent, a))(inputs)
        yardstick = jax.jit(lambda a: outputs(gated_delta.recurrent, tuple(t.astype(jnp.float32) for t in a)))(
            rounded)
    chunked = jax.jit(lambda a: outputs(gated_delta.chunked, a))(rounded)  # the default precision, as training
    return [_row("gated delta rule", name, got, e, r)
            for name, got, e, r in zip(GATED_DELTA_OUTPUTS, chunked, exact, yardstick)]


if __name__ == "__main__":
    sys.exit(main())
