"""Times the Triton grouped matmul's tile shapes on one GPU.

The kernels (`jlong.moe.grouped_matmul_triton`) take their tile shape and
Triton's warps and pipeline stages from module constants; this times each
candidate on the products an expert layer runs, routed rows near-balanced
over the experts as a trained router leaves them:

- up: ROWS x HIDDEN -> INTERMEDIATE (gate and up projections), forward,
  the input's gradient (the transposed product) and the weights' gradient;
- down: ROWS x INTERMEDIATE -> HIDDEN, forward.

    python experiments/grouped_matmul_tiles.py [--rows 65536 --hidden 2048 --intermediate 512 --experts 128]

Prints TFLOP/s (FLOPs of the routed rows) per candidate, best first, and
writes them as JSON to --out (experiments/results/grouped-matmul-tiles.json).
A minute or two on one H100; exits 2 without a GPU.
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
from jlong.moe import grouped_matmul_triton as kernels

CANDIDATES = {"BLOCK_M": (64, 128), "BLOCK_N": (128, 256), "BLOCK_K": (64, 128), "NUM_WARPS": (4, 8),
              "NUM_STAGES": (3,)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=65536, help="routed rows: tokens x experts per token")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--deadline-s", type=float, default=150.0, help="candidates not started by then are left out")
    parser.add_argument("--out", type=Path, default=RESULTS / "grouped-matmul-tiles.json",
                        help="the JSON file to write (default: experiments/results/grouped-matmul-tiles.json)")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print(f"grouped_matmul_tiles needs a GPU; this backend is {jax.default_backend()}", file=sys.stderr)
        return 2
    started = time.monotonic()
    keys = jax.random.split(jax.random.key(0), 4)
    R, H, I, G = args.rows, args.hidden, args.intermediate, args.experts
    x = jax.random.normal(keys[0], (R, H), jnp.bfloat16)
    w_up = jax.random.normal(keys[1], (G, H, I), jnp.bfloat16)
    w_down = jax.random.normal(keys[2], (G, I, H), jnp.bfloat16)
    dy = jax.random.normal(keys[3], (R, I), jnp.bfloat16)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(R, np.full(G, 1 / G)), jnp.int32)
    flops = 2.0 * R * H * I
    products = {  # each a function and its operands (passed, not closed over: no constants in the program)
        "up forward": (lambda x, w, s: kernels._product(x, w, s, transpose_w=False, interpret=False), (x, w_up)),
        "up dx": (lambda dy, w, s: kernels._product(dy, w, s, transpose_w=True, interpret=False), (dy, w_up)),
        "up dw": (lambda x, dy, s: kernels._weight_gradient(x, dy, s, jnp.bfloat16, interpret=False), (x, dy)),
        "down forward": (lambda h, w, s: kernels._product(h, w, s, transpose_w=False, interpret=False),
                         (dy, w_down)),
    }
    results = []
    names = list(CANDIDATES)
    for values in itertools.product(*CANDIDATES.values()):
        if time.monotonic() - started > args.deadline_s:
            break
        for name, value in zip(names, values):
            setattr(kernels, name, value)  # read by the kernels when traced
        row = dict(zip(names, values))
        for product, (run, operands) in products.items():
            try:
                row[product] = round(flops / median_seconds(jax.jit(run), *operands, sizes) / 1e12, 1)
            except Exception as error:  # a tile Triton cannot fit (shared memory) is reported, the rest go on
                row[product] = None
                row.setdefault("errors", []).append(f"{product}: {str(error).splitlines()[0][:160]}")
        results.append(row)
        print(json.dumps(row), flush=True)
    results.sort(key=lambda r: -sum(r[p] or 0 for p in products))
    command = invocation(__file__, [portable(a) for a in argv or sys.argv[1:]])
    args.out.write_text(json.dumps({"command": command, "commit": commit(), "date": today(),
                                    "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                                    "shape": {"rows": R, "hidden": H, "intermediate": I, "experts": G},
                                    "results": results}, indent=1) + "\n")
    for row in results[:5]:
        print("best:", json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
