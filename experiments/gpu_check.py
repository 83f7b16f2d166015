"""Checks cuDNN's fused attention paths against the reference kernel on one GPU.

The cuDNN step kernel (`jlong.attention.cudnn`) is tested on CPU with an
emulation in place of the cuDNN calls, and its programs compile for H100s
deviceless; whether cuDNN computes what jlong asks of it can only be seen on
a GPU. This runs each path jlong uses, in bf16, against the blockwise kernel
in float32 on the same inputs, and prints the worst error of every output
beside the blockwise kernel's own bf16 error as the yardstick:

- causal: a device's own chunk (and local attention), grouped-query heads;
- packed: documents in cuDNN's ragged mode, grouped-query heads;
- off-diagonal: a ring step over earlier keys, plain and packed (one
  document spanning the boundary);
- sliding window: a causal step within cuDNN's own sliding window (Gemma 3's
  local layers), plain and packed;
- every backward pass given an output and log-sum-exp from outside the step
  (those of the whole softmax, as a ring merges them);
- attention sinks (GPT-OSS's, with its sliding window over packed
  documents): local attention as a one-step ring takes them in from
  cuDNN's output and log-sum-exp and hands its backward pass the sink
  softmax's; output and the gradients of q, k, v and the sink logits.

    python experiments/gpu_check.py [--seq-len 8192]

Minutes on one H100. Exits 1 if any error exceeds twice the yardstick (plus
1e-3 of the output's scale), 2 without a GPU.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.cudnn import CudnnStep
from jlong.attention.ring import ring_attention
from jlong.attention.step import MASKED, Band, Documents

OUTPUTS = ("o", "lse", "dq", "dk", "dv")
SINK_OUTPUTS = ("o", "dq", "dk", "dv", "dsinks")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens of each step's window (even)")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--documents", type=int, default=12, help="packed documents per sequence")
    parser.add_argument("--window", type=int, default=1024, help="the sliding window of the windowed paths")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"gpu_check needs a GPU with cuDNN; this backend is {jax.default_backend()}", file=sys.stderr)
        return 2
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = check_all(args.seq_len, args.heads, args.kv_heads, args.head_dim, args.documents, args.window)
    failed = [row for row in rows if not row["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} outputs within bounds")
    return 1 if failed else 0


def check_all(seq_len, heads, kv_heads, head_dim, documents, window=1024, *, print_rows=True) -> list[dict]:
    """One row per (path, output): the worst error of cuDNN and of blockwise bf16 against blockwise float32."""
    rng = np.random.default_rng(0)
    T = seq_len
    q, k, v, do = (jax.random.normal(key, (1, T, h, head_dim), jnp.float32)
                   for key, h in zip(jax.random.split(jax.random.key(0), 4), (heads, kv_heads, kv_heads, heads)))
    ids = np.cumsum(np.isin(np.arange(T), rng.choice(np.arange(1, T), documents - 1, replace=False)))[None]
    shared = np.r_[np.zeros(T // 2, int), np.ones(T - T // 2, int)][None]  # keys' last document goes on
    packed = Documents(jnp.asarray(ids), jnp.asarray(ids))
    paths = {
        "causal": (None, True, None),
        "packed": (packed, True, None),
        "off-diagonal": (None, False, None),
        "off-diagonal packed": (Documents(jnp.asarray(shared + 1), jnp.asarray(shared)), False, None),
        "sliding window": (None, True, Band(window)),
        "sliding window packed": (packed, True, Band(window)),
        "sinks sliding window packed": (packed, True, Band(window)),
    }
    sinks = jnp.linspace(-3.0, 3.0, heads)  # logits far from zero both ways
    rows = []
    for name, (docs, causal, band) in paths.items():
        run, outputs = (functools.partial(_run_with_sinks, sinks=sinks), SINK_OUTPUTS) if "sinks" in name \
            else (_run, OUTPUTS)
        exact = run(BlockwiseStep(512), q, k, v, do, docs, causal, band, jnp.float32)
        fused = run(CudnnStep(max(documents, 2)), q, k, v, do, docs, causal, band, jnp.bfloat16)
        yardstick = run(BlockwiseStep(512), q, k, v, do, docs, causal, band, jnp.bfloat16)
        for output in outputs:
            e = exact[output]
            scale = float(np.abs(e[e > MASKED / 2]).max())  # log-sum-exps of rows that see nothing are MASKED
            err_fused = float(np.abs(fused[output] - e).max())
            err_bf16 = float(np.abs(yardstick[output] - e).max())
            row = {"path": name, "output": output, "cudnn": err_fused, "blockwise_bf16": err_bf16,
                   "ok": err_fused <= 2 * err_bf16 + 1e-3 * scale}
            rows.append(row)
            if print_rows:
                print(f"{name:>27} {output:>6}: cuDNN {err_fused:.3e}  blockwise bf16 {err_bf16:.3e}"
                      f"  {'ok' if row['ok'] else 'TOO FAR'}")
    return rows


def _run(kernel, q, k, v, do, docs, causal, band, dtype):
    """The step's forward (o, lse) and its backward given the float32 output
    and log-sum-exp of the whole softmax (here: the exact step's own, a stand-in
    a ring would merge), as float32 numpy arrays."""
    cast = [x.astype(dtype) for x in (q, k, v, do)]
    o_exact, lse_exact = BlockwiseStep(512).forward(q, k, v, docs, causal, band)

    @jax.jit
    def step(q, k, v, do, o_exact, lse_exact):
        o, lse = kernel.forward(q, k, v, docs, causal, band)
        dq, dk, dv = kernel.backward(q, k, v, docs, causal, o_exact.astype(q.dtype), lse_exact, do, band)
        return o, lse, dq, dk, dv

    results = step(*cast, o_exact, lse_exact)
    return {name: np.asarray(x, np.float32) for name, x in zip(OUTPUTS, results)}


def _run_with_sinks(kernel, q, k, v, do, docs, causal, band, dtype, *, sinks):
    """Causal local attention with sink logits (float32, as the model keeps
    them) through the kernel: output and the gradients of q, k, v and the
    sinks, as float32 numpy arrays."""
    segments = None if docs is None else docs.q

    @jax.jit
    def attend(q, k, v, do, sinks):
        o, pullback = jax.vjp(lambda q, k, v, s: ring_attention(q, k, v, segments, kernel=kernel, axis=None, size=1,
                                                                band=band, sink_logits_H=s), q, k, v, sinks)
        return o, *pullback(do)

    results = attend(*(x.astype(dtype) for x in (q, k, v, do)), sinks)
    return {name: np.asarray(x, np.float32) for name, x in zip(SINK_OUTPUTS, results)}


if __name__ == "__main__":
    sys.exit(main())
