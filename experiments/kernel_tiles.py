"""Times the Pallas kernels' tile shapes on one GPU.

The kernels take their tiles, Triton's warps and its pipeline stages (or
Mosaic GPU's steps in flight) from module constants, which this sets
candidate by candidate before tracing:

- grouped matmul (`jlong.moe.grouped_matmul_triton`): the products' tiles
  on ROWS x HIDDEN -> INTERMEDIATE forward, its input's gradient (the
  transposed product) and the down projection's forward, then the weight
  gradient's own tiles on its weights' gradient; routed rows near-balanced
  over the experts as a trained router leaves them; TFLOP/s of the routed
  rows; then the Mosaic GPU grouped matmul
  (`jlong.moe.grouped_matmul_mosaic`) on all four, its tiles shared;
- gated delta (`jlong.linear_attention.gated_delta_triton`): the state
  recurrence's forward and backward kernels alone, on chunk terms of
  TOKENS x HEADS heads of 128 in bf16; tokens/s.

    python experiments/kernel_tiles.py [--deadline-s 200] [--out FILE]

Prints each candidate as it is timed, then the best per kernel, and writes
them as JSON to --out (experiments/results/kernel-tiles.json). About three
minutes on one H100; exits 2 without a GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import RESULTS, commit, invocation, median_seconds, portable, today
from jlong.linear_attention import gated_delta_triton
from jlong.moe import grouped_matmul_mosaic, grouped_matmul_triton

# Tried in this order (the last setting varies fastest), the likelier first: a deadline cuts the rest.
GROUPED_CANDIDATES = {"BLOCK_M": (128, 64), "BLOCK_N": (256, 128), "BLOCK_K": (64,), "NUM_WARPS": (8, 4),
                      "NUM_STAGES": (4, 3)}
WEIGHT_GRADIENT_CANDIDATES = {"WGRAD_BLOCK_M": (64, 128), "WGRAD_BLOCK_N": (128, 256), "WGRAD_BLOCK_K": (64,),
                              "WGRAD_NUM_WARPS": (8, 4), "WGRAD_NUM_STAGES": (4, 3)}
MOSAIC_CANDIDATES = {"BLOCK_M": (128, 64), "BLOCK_N": (128, 64), "BLOCK_K": (64,), "WGRAD_BLOCK_M": (64, 128),
                     "STAGES": (4, 3, 2)}
GATED_DELTA_CANDIDATES = {"BLOCK_V": (32, 16, 64), "NUM_WARPS": (4, 2), "NUM_STAGES": (2, 3, 1)}
REPEATS = 20  # calls of about a millisecond each: fewer left a quarter's spread between equal kernels
PASSES = {"grouped_matmul": ("up forward", "up dx", "down forward"), "grouped_matmul_weight_gradient": ("up dw",),
          "grouped_matmul_mosaic": ("up forward", "up dx", "down forward", "up dw"),
          "gated_delta": ("forward", "backward")}  # a report's sections and the rates each is ranked by
KERNELS = tuple(PASSES)
RATES = ("up forward", "up dx", "up dw", "down forward", "forward", "backward")  # a row's rates, not its settings


def grouped_matmul_passes(rows: int, hidden: int, intermediate: int, experts: int, kernels=grouped_matmul_triton):
    """{pass: (function, operands)} of `kernels`' products (forward, input gradient) and of its weight
    gradient, and the FLOPs of one pass."""
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (rows, hidden), jnp.bfloat16)
    w_up = jax.random.normal(keys[1], (experts, hidden, intermediate), jnp.bfloat16)
    w_down = jax.random.normal(keys[2], (experts, intermediate, hidden), jnp.bfloat16)
    dy = jax.random.normal(keys[3], (rows, intermediate), jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(rows, np.full(experts, 1 / experts)), jnp.int32)
    products = {  # each a function and its operands (passed, not closed over: no constants in the program)
        "up forward": (lambda x, w, s: kernels._product(x, w, s, transpose_w=False, interpret=False), (x, w_up, sizes)),
        "up dx": (lambda dy, w, s: kernels._product(dy, w, s, transpose_w=True, interpret=False), (dy, w_up, sizes)),
        "down forward": (lambda h, w, s: kernels._product(h, w, s, transpose_w=False, interpret=False),
                         (dy, w_down, sizes)),
    }
    weight_gradient = {
        "up dw": (lambda x, dy, s: kernels._weight_gradient(x, dy, s, jnp.bfloat16, interpret=False), (x, dy, sizes)),
    }
    return products, weight_gradient, 2.0 * rows * hidden * intermediate


def gated_delta_passes(tokens: int, heads: int, width: int = 128, chunk: int = gated_delta_triton.CHUNK):
    """{pass: (function, operands)} of the recurrence kernels on random chunk terms, and the tokens of one pass."""
    kernels = gated_delta_triton
    n = tokens // chunk
    keys = iter(jax.random.split(jax.random.key(1), 8))
    terms = lambda *shape: (0.1 * jax.random.normal(next(keys), (heads, n, *shape))).astype(jnp.bfloat16)  # noqa: E731
    u, w, a, qr, kw, do = terms(chunk, width), terms(chunk, width), terms(chunk, chunk), terms(chunk, width), \
        terms(chunk, width), terms(chunk, width)
    decay = jax.random.uniform(next(keys), (heads, n), jnp.float32, 0.5, 1.0)
    state = jnp.zeros((heads, width, width), jnp.float32)
    passes = {
        "forward": (lambda *t: kernels._forward(*t, interpret=False), (u, w, kw, decay, state)),
        "backward": (lambda *t: kernels._backward(*t, interpret=False), (do, state, w, a, qr, kw, decay)),
    }
    return passes, tokens


def sweep(module, candidates: dict, passes: dict, work: float, unit: float, deadline: float) -> list[dict]:
    """Each candidate's rate per pass (work / seconds / unit), as far as the deadline (time.monotonic) allows."""
    names, results = list(candidates), []
    for values in itertools.product(*candidates.values()):
        if time.monotonic() > deadline:
            break
        for name, value in zip(names, values):
            setattr(module, name, value)  # read by the kernels when traced
        jax.clear_caches()  # else jit reuses the first candidate's trace: the same function, the same operands
        row = dict(zip(names, values))
        for name, (run, operands) in passes.items():
            try:
                row[name] = round(work / median_seconds(jax.jit(run), *operands, repeats=REPEATS) / unit, 2)
            except Exception as error:  # a tile Triton cannot fit (shared memory) is reported, the rest go on
                row[name] = None
                row.setdefault("errors", []).append(f"{name}: {str(error).splitlines()[0][:160]}")
        results.append(row)
        print(module.__name__.rsplit(".", 1)[-1], json.dumps(row), flush=True)
    results.sort(key=lambda r: -sum(r[p] or 0 for p in passes))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536,
                        help="grouped matmul: routed rows, tokens x experts per token")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=32768, help="gated delta: tokens of one sequence")
    parser.add_argument("--heads", type=int, default=16, help="gated delta: heads of 128")
    parser.add_argument("--deadline-s", type=float, default=200.0,
                        help="the four sweeps' time in all (the Triton products, its weight gradient, the Mosaic GPU "
                        "kernels, the gated delta recurrence); candidates not started in time are left out")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernel-tiles.json",
                        help="the JSON file to write (default: experiments/results/kernel-tiles.json)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"kernel_tiles needs a GPU; this backend is {jax.default_backend()}", file=sys.stderr)
        return 2
    tallest = max(*GROUPED_CANDIDATES["BLOCK_M"], *WEIGHT_GRADIENT_CANDIDATES["WGRAD_BLOCK_M"],
                  *MOSAIC_CANDIDATES["BLOCK_M"], *MOSAIC_CANDIDATES["WGRAD_BLOCK_M"])
    if args.rows % tallest:  # the kernels are timed without grouped_matmul's padding to whole tiles
        print(f"kernel_tiles: --rows must be a multiple of {tallest}, got {args.rows}", file=sys.stderr)
        return 2
    started = time.monotonic()
    products, weight_gradient, flops = grouped_matmul_passes(args.rows, args.hidden, args.intermediate, args.experts)
    mosaic_products, mosaic_weight_gradient, _ = grouped_matmul_passes(
        args.rows, args.hidden, args.intermediate, args.experts, grouped_matmul_mosaic)
    gated, tokens = gated_delta_passes(args.tokens, args.heads)
    shape = {"rows": args.rows, "hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts}
    report = {
        "command": invocation(__file__, [portable(a) for a in argv or sys.argv[1:]]),
        "commit": commit(), "date": today(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "grouped_matmul": {
            "shape": shape,
            "unit": "TFLOP/s",
            "results": sweep(grouped_matmul_triton, GROUPED_CANDIDATES, products, flops, 1e12,
                             started + args.deadline_s * 0.35),
        },
        "grouped_matmul_weight_gradient": {
            "shape": shape,
            "unit": "TFLOP/s",
            "results": sweep(grouped_matmul_triton, WEIGHT_GRADIENT_CANDIDATES, weight_gradient, flops, 1e12,
                             started + args.deadline_s * 0.5),
        },
        "grouped_matmul_mosaic": {
            "shape": shape,
            "unit": "TFLOP/s",
            "results": sweep(grouped_matmul_mosaic, MOSAIC_CANDIDATES, {**mosaic_products, **mosaic_weight_gradient},
                             flops, 1e12, started + args.deadline_s * 0.7),
        },
        "gated_delta": {
            "shape": {"tokens": args.tokens, "heads": args.heads, "dk": 128, "dv": 128},
            "unit": "million tokens/s",
            "results": sweep(gated_delta_triton, GATED_DELTA_CANDIDATES, gated, tokens, 1e6,
                             started + args.deadline_s),
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    for kernel in KERNELS:
        for row in report[kernel]["results"][:3]:
            print(f"best {kernel}:", json.dumps(row))
    return 0


def best_settings(report: dict, kernel: str) -> dict:
    """The module constants of `kernel`'s fastest candidate in a report this script wrote ({} if none
    ran): ranked and filtered on that kernel's own passes only (a report written before the weight
    gradient had its own tiles times it among the products' passes)."""
    own = PASSES[kernel]
    ran = [r for r in report[kernel]["results"] if all(r.get(p) for p in own)]
    if not ran:
        return {}
    best = max(ran, key=lambda r: sum(r[p] for p in own))
    return {k: v for k, v in best.items() if k not in RATES and k != "errors"}


if __name__ == "__main__":
    sys.exit(main())
