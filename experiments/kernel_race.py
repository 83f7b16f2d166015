"""Races jlong's GPU kernels against what a PyTorch user would run, on one
GPU in one run: Gated DeltaNet's chunked rule against flash-linear-attention
(FLA), the experts' grouped matmul against `torch._grouped_mm` and a dense
GEMM of equal FLOPs. Same shapes, dtypes and inputs side by side; medians of
repeated calls after warm-up (and after FLA's autotuning), forward and
forward + backward; each kernel's error against a float32 reference.

    python experiments/kernel_race.py [--out DIR]            # one GPU, about 3 minutes
    python experiments/kernel_race.py --rehearse --out DIR   # the CPU: jlong's kernels interpreted, tiny shapes

jax and PyTorch each run in a child process of their own (one after the
other, so neither holds GPU memory the other needs); the parent writes
`kernel-race.json` and `kernel-race.md` in DIR (default experiments/results),
and on a GPU `kernel-runs.json` beside them: which of jlong's GPU kernels ran
there (`jlong.kernel_runs`: `auto` picks no kernel that record lacks, and
the planner names every kernel it prices without one). Each jlong row names
the GPU kernels its compiled program ran (`gpu_kernels`; a row that did not
compile names those its registry entry runs).
FLA is imported from wherever Python finds `fla` (the device wheels' README
says how to carry it). Rows a framework could not run say "not run"; a
kernel that fails says "failed" with its error, and the race goes on.

- Gated DeltaNet (every GPU rule of `gated_delta.KERNELS` and the chunked
  XLA one; bf16 q, k, v; float32 log decays g and write strengths
  beta; q and k unit-norm, no scale: FLA's `scale=1`, its L2 norm off): B=1,
  T in 8,192 / 32,768 / 131,072, 16 heads of 128, and Qwen3.5-27B's heads on
  one of 8 sp devices (2 key and 6 value heads of 128) at 131,072. Errors
  at the first length, against the rule token by token in float32 at the
  highest precision (`gated_delta.recurrent`): the output (forward), and the
  worst of q's, k's, v's, g's and beta's gradients (forward + backward), each
  relative to the reference's largest magnitude.
- Grouped matmul (bf16, float32 accumulation): 65,536 routed rows at
  Qwen3-30B-A3B's expert shapes (128 experts, 2048 -> 768 and 768 -> 2048) and
  Qwen3.5-35B-A3B's (256 experts, 2048 -> 512), rows spread evenly and
  skewed (a quarter of the experts take half the rows). TFLOP/s count the
  routed rows' 2 M K N per product (three products forward + backward).
  Errors against each group's product in float32 at the highest precision.
- Dense GEMM: [M, K] x [K, N] with the same M, K, N (the grouped matmul's
  FLOPs in one product).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jlong.jax_startup import import_jax_quietly

import_jax_quietly()  # before `common` imports jax: no CUDA plugin's "no driver" lines on a CPU machine

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from common import RESULTS, commit, markdown_table, median_seconds, portable, today  # noqa: E402

from jlong import kernel_runs  # noqa: E402

GATED_DELTA_SHAPES = [  # (label, B, T, Hk, H, D)
    ("16 heads", 1, 8_192, 16, 16, 128),
    ("16 heads", 1, 32_768, 16, 16, 128),
    ("16 heads", 1, 131_072, 16, 16, 128),
    ("Qwen3.5-27B, sp=8", 1, 131_072, 2, 6, 128),
]
GATED_DELTA_REHEARSAL = [("tiny", 1, 96, 2, 4, 64), ("tiny", 1, 192, 2, 4, 64)]  # the Mosaic GPU rule: widths of 64
GROUPED_SHAPES = [  # (label, M, K, N, G, k)
    ("Qwen3-30B-A3B gate/up", 65_536, 2048, 768, 128, 8),
    ("Qwen3-30B-A3B down", 65_536, 768, 2048, 128, 8),
    ("Qwen3.5-35B-A3B", 65_536, 2048, 512, 256, 8),
]
GROUPED_REHEARSAL = [("tiny", 256, 64, 64, 8, 2)]  # the Mosaic GPU kernel: widths of 64
QUICK_LENGTHS = (8_192, 32_768)  # --quick: two lengths of 16 heads and the first expert shape
DISTRIBUTIONS = ("uniform", "skewed")
REPEATS = 10  # calls per median: 5 left a spread of a quarter between runs of millisecond kernels
PEAK_BF16 = 989e12  # H100 and H200 SXM, dense bf16 (jlong.planner.targets)


# ---------------------------------------------------------------- inputs, shared by both frameworks (numpy)

def gated_delta_inputs(B, T, Hk, H, D, seed=0):
    """Unit-norm q, k [B, T, Hk, D] and v [B, T, H, D] (float32, to be rounded to bf16), log decays g and write
    strengths beta [B, T, H] as Gated DeltaNet makes them, and a cotangent do [B, T, H, D]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(rng.standard_normal((B, T, Hk, D), np.float32))
    k = unit(rng.standard_normal((B, T, Hk, D), np.float32))
    v = rng.standard_normal((B, T, H, D), np.float32)
    g = -np.logaddexp(0.0, rng.standard_normal((B, T, H), np.float32) - 3.0).astype(np.float32)  # -softplus
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, H), np.float32)))).astype(np.float32)
    do = rng.standard_normal((B, T, H, D), np.float32)
    return q, k, v, g, beta, do


def group_sizes(M: int, G: int, distribution: str):
    """Rows per group: even, or a quarter of the groups taking half the rows; summing to M."""
    import numpy as np

    if distribution == "uniform":
        weights = np.ones(G)
    else:
        weights = np.where(np.arange(G) < G // 4, 0.5 / (G // 4), 0.5 / (G - G // 4))
    sizes = np.floor(weights / weights.sum() * M).astype(np.int32)
    sizes[: M - sizes.sum()] += 1
    return sizes


def grouped_inputs(M, K, N, G, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K), np.float32)
    w = (rng.standard_normal((G, K, N), np.float32) / np.sqrt(K)).astype(np.float32)
    dy = rng.standard_normal((M, N), np.float32)
    return x, w, dy


def relative_error(got, want) -> float:
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def pass_error(pass_: str, got, forward_reference, backward_references) -> float:
    """A row's error: its output's (fwd), or the worst of its gradients' (fwd+bwd)."""
    if pass_ == "fwd":
        return relative_error(got, forward_reference)
    return max(relative_error(a, b) for a, b in zip(got, backward_references))


def row(kernel, impl, pass_, shape, *, status="ok", tokens_per_s=None, tflops=None, error=None, seconds=None,
        note=None, gpu_kernels=()) -> dict:
    found = {"kernel": kernel, "impl": impl, "pass": pass_, "shape": shape, "status": status,
             "tokens_per_s": tokens_per_s, "tflops": tflops, "max_rel_error": error, "seconds": seconds,
             "note": note, "gpu_kernels": sorted(gpu_kernels)}
    if STREAM is not None:  # each row as it is measured: a part stopped by its time limit keeps what it had
        with STREAM.open("a") as out:
            out.write(json.dumps(found) + "\n")
        print(f"kernel_race: {time.perf_counter() - STARTED:.0f} s: {json.dumps(found)}", flush=True)
    return found


STREAM: Path | None = None  # a part's rows file (`workdir/PART.jsonl`)
STARTED = time.perf_counter()


def failed(kernel, impl, pass_, shape, exc, gpu_kernels=()) -> dict:
    message = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return row(kernel, impl, pass_, shape, status="failed", note=f"{type(exc).__name__}: {message}",
               gpu_kernels=gpu_kernels)


def compiled(fn, *args):
    """`fn` (jitted) compiled for `args`, and the names of jlong's GPU kernels its program runs (none on the
    CPU, where they are interpreted): the race times this very program."""
    from jlong.planner.hlo import parse_module
    from jlong.planner.pricing import gpu_kernels_in

    program = fn.lower(*args).compile()
    return program, gpu_kernels_in(parse_module(program.as_text()))


# ---------------------------------------------------------------- the jax part

def gated_delta_shapes(quick: bool) -> list:
    return [s for s in GATED_DELTA_SHAPES if s[0] == "16 heads" and s[2] in QUICK_LENGTHS] if quick else \
        GATED_DELTA_SHAPES


def grouped_shapes(quick: bool) -> list:
    return GROUPED_SHAPES[:1] if quick else GROUPED_SHAPES


def jax_part(rehearse: bool, quick: bool, workdir: Path, tiles: Path | None = None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jlong.linear_attention import gated_delta, gated_delta_triton
    from jlong.moe import grouped_matmul, grouped_matmul_mosaic, grouped_matmul_triton

    settings = _set_tiles(tiles, {"grouped_matmul": grouped_matmul_triton,
                                  "grouped_matmul_weight_gradient": grouped_matmul_triton,
                                  "grouped_matmul_mosaic": grouped_matmul_mosaic,
                                  "gated_delta": gated_delta_triton})

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not rehearse:
        raise SystemExit(2)
    versions, device = _jax_versions(on_gpu), _jax_device()
    _known_early(workdir / "jax", {"versions": versions, "device": device, "tiles": settings})
    interpret = not on_gpu
    repeats = 1 if rehearse else REPEATS

    median = functools.partial(median_seconds, repeats=repeats)
    rows, rates = [], []
    raced = [name for name in gated_delta.KERNELS if name in gated_delta.GPU_KERNELS or name == "chunked"]
    kernels = {f"jlong:{name}": gated_delta.rule(name, interpret=interpret) for name in raced}
    for index, (label, B, T, Hk, H, D) in enumerate(GATED_DELTA_REHEARSAL if rehearse else gated_delta_shapes(quick)):
        shape = {"B": B, "T": T, "H": H, "Hk": Hk, "D": D, "label": label}
        q, k, v, g, beta, do = gated_delta_inputs(B, T, Hk, H, D)
        bf16 = [jnp.asarray(t, jnp.bfloat16) for t in (q, k, v)]
        f32 = [jnp.asarray(t) for t in (g, beta)]
        cotangent = jnp.asarray(do, jnp.bfloat16)
        reference = None
        print(f"kernel_race: gated delta at {shape}", flush=True)
        if index == 0:  # the numerics: the rule token by token in float32, from the bf16-rounded inputs
            rounded = [t.astype(jnp.float32) for t in bf16] + f32
            with jax.default_matmul_precision("highest"):
                reference = _gated_delta_outputs(gated_delta.recurrent, rounded, cotangent.astype(jnp.float32))
            np.savez(workdir / "gated_delta_reference.npz", *[np.asarray(t) for t in reference])
        args = (*bf16, *f32, cotangent)  # the cotangent an argument, not a constant compiled in
        for impl, rule in kernels.items():
            forward = jax.jit(lambda *a, rule=rule: rule(*a[:5])[0])
            # o with the gradients: a training step needs it (PyTorch computes FLA's either way)
            both = jax.jit(lambda *a, rule=rule: _gated_delta_outputs(rule, a[:5], a[5]))
            for pass_, jitted in (("fwd", forward), ("fwd+bwd", both)):
                ran = gated_delta.GPU_KERNEL_NAMES.get(impl.removeprefix("jlong:"), ())  # until compiled
                try:
                    fn, ran = compiled(jitted, *args)
                    seconds = median(fn, *args)
                    error = None
                    if reference is not None:
                        got = jax.block_until_ready(fn(*args))  # nothing queued behind it
                        error = pass_error(pass_, got if pass_ == "fwd" else got[1:], reference[0], reference[1:])
                    rows.append(row("gated_delta", impl, pass_, shape, tokens_per_s=B * T / seconds, error=error,
                                    seconds=seconds, gpu_kernels=ran))
                except Exception as exc:  # noqa: BLE001 (a failing kernel is a row, the race goes on)
                    rows.append(failed("gated_delta", impl, pass_, shape, exc, ran))
        if on_gpu and T == 32_768:
            rates.extend(_recurrence_rates(bf16, f32, cotangent, shape, median))
    for label, M, K, N, G, topk in GROUPED_REHEARSAL if rehearse else grouped_shapes(quick):
        x, w, dy = grouped_inputs(M, K, N, G)
        xb, wb, dyb = (jnp.asarray(t, jnp.bfloat16) for t in (x, w, dy))
        for distribution in DISTRIBUTIONS:
            shape = {"M": M, "K": K, "N": N, "G": G, "k": topk, "label": label, "rows": distribution}
            sizes = group_sizes(M, G, distribution)
            reference = _grouped_reference(xb, wb, dyb, sizes)
            for name in (n for n in grouped_matmul.KERNELS if n in grouped_matmul.GPU_KERNELS):
                product = grouped_matmul.matmul(name, interpret=interpret)
                rows.extend(_matmul_rows("grouped_matmul", f"jlong:{name}", product, (xb, wb, jnp.asarray(sizes)), dyb,
                                         shape, 2.0 * M * K * N, reference, median,
                                         grouped_matmul.GPU_KERNEL_NAMES[name]))
        dense_shape = {"M": M, "K": K, "N": N, "label": label}
        rows.extend(_matmul_rows("dense_gemm", "jax", lambda x, w: x @ w, (xb, wb[0]), dyb, dense_shape,
                                 2.0 * M * K * N, None, median))
    return {"rows": rows, "rates": rates, "versions": versions, "device": device, "tiles": settings}


def _known_early(part: Path, found: dict) -> None:
    """What a part knows before it measures (versions, device), kept where a part stopped early is read back."""
    part.with_suffix(".early.json").write_text(json.dumps(found))


def _set_tiles(tiles: Path | None, modules: dict) -> dict:
    """Each kernel module's constants set to the fastest candidate of a
    `kernel_tiles.py` report (none: the modules' own); the settings run."""
    from kernel_tiles import best_settings

    report = json.loads(tiles.read_text()) if tiles else None
    settings = {}
    for kernel, module in modules.items():
        chosen = best_settings(report, kernel) if report and kernel in report else {}
        for name, value in chosen.items():
            setattr(module, name, value)  # read by the kernels when traced
        settings[kernel] = {"from": str(tiles.name) if chosen else "the module's defaults", **chosen}
    return settings


def _gated_delta_outputs(rule, inputs, cotangent):
    """(o, dq, dk, dv, dg, dbeta) of the rule with cotangent `do` on o."""
    o, pullback = __import__("jax").vjp(lambda *a: rule(*a)[0], *inputs)
    return (o, *pullback(cotangent.astype(o.dtype)))


def _recurrence_rates(bf16, f32, cotangent, shape, median) -> list[dict]:
    """The Triton and Mosaic GPU rules' two recurrence kernels alone: their TFLOP/s (the planner prices
    them at it)."""
    import jax
    import jax.numpy as jnp

    from jlong.linear_attention import chunks, gated_delta_mosaic as gdm, gated_delta_triton as gdt
    from jlong.ops.pallas_calls import TRITON_CALL

    q, k, v = bf16
    g, beta = f32
    (q, k, v, g, beta), seg, prev, state = chunks.padded_inputs((q, k, v, g, beta), None, None, None,
                                                              multiple=gdt.CHUNK)
    B, T, H, dv = v.shape
    terms = chunks.chunk_terms(q, k, v, g, beta, seg, prev, chunk=gdt.CHUNK)
    heads = lambda t: t.reshape(B * H, *t.shape[2:])  # noqa: E731
    mats = [heads(t).astype(jnp.bfloat16) for t in (terms.u, terms.w, terms.a, terms.qr, terms.kw)]
    decay, state = heads(terms.decay), heads(state)
    u, w, a, qr, kw = mats
    do = jnp.moveaxis(cotangent.reshape(B, T, H, dv), 2, 1).reshape(B * H, -1, gdt.CHUNK, dv)
    dims = [list(m.shape) for m in mats]
    rows = [[B * H * T, dv], [B * H * T, w.shape[-1]]]  # the Mosaic calls' operands: a row per token
    flops = {  # the planner's formulas, from each kernel's call as a compiled program shows it
        gdt.FORWARD: gdt.call_flops(TRITON_CALL, f'name = "{gdt.FORWARD}", num_stages', dims, ()),
        gdt.BACKWARD: gdt.call_flops(TRITON_CALL, f'name = "{gdt.BACKWARD}", num_stages', dims, ()),
        gdm.FORWARD: gdm.call_flops(gdm.MOSAIC_CALL, f'op_name="x/{gdm.FORWARD}/y"', rows, ()),
        gdm.BACKWARD: gdm.call_flops(gdm.MOSAIC_CALL, f'op_name="x/{gdm.BACKWARD}/y"', rows, ()),
    }
    result = []
    for impl, module, passes in (("triton", gdt, (gdt._forward, gdt._backward)),
                                 ("mosaic", gdm, (gdm.forward, gdm.backward))):
        try:
            forward, backward = (jax.jit(functools.partial(kernels, interpret=False)) for kernels in passes)
            _, states, _ = forward(u, w, kw, decay, state)
            for name, kernel, fn, args in (("forward", module.FORWARD, forward, (u, w, kw, decay, state)),
                                           ("backward", module.BACKWARD, backward,
                                            (do, states[:, 0], w, a, qr, kw, decay))):
                seconds = median(fn, *args)
                result.append({"name": f"gated_delta recurrence {name} ({impl})", "shape": shape,
                               "seconds": seconds, "tflops": flops[kernel] / seconds / 1e12,
                               "share_of_bf16_peak": flops[kernel] / seconds / PEAK_BF16})
        except Exception as exc:  # noqa: BLE001 (a kernel that fails leaves the other's rates)
            print(f"kernel_race: the {impl} recurrence kernels failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
    return result


def _grouped_reference(x, w, dy, sizes):
    """(y, dx, dw) group by group in float32 at the highest precision: each
    group's rows gathered into a window of the largest group's size (the
    rows past its own size zero), one batched product per output."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    starts, widest = np.cumsum(sizes) - sizes, int(sizes.max())
    index = starts[:, None] + np.arange(widest)[None]  # [G, widest]
    real = np.arange(widest)[None] < sizes[:, None]
    index = np.where(real, index, 0)

    @jax.jit
    def products(x, w, dy):
        x, w, dy = (t.astype(jnp.float32) for t in (x, w, dy))
        x_win, dy_win = (jnp.where(real[..., None], t[index], 0.0) for t in (x, dy))
        precise = jax.lax.Precision.HIGHEST
        y = jnp.einsum("gmk,gkn->gmn", x_win, w, precision=precise)
        dx = jnp.einsum("gmn,gkn->gmk", dy_win, w, precision=precise)
        return y, dx, jnp.einsum("gmk,gmn->gkn", x_win, dy_win, precision=precise)

    y, dx, dw = (np.asarray(t) for t in products(x, w, dy))
    return y[real], dx[real], dw  # windows back to rows in order: groups are consecutive


def _matmul_rows(kernel, impl, product, args, dy, shape, flops, reference, median, gpu_kernels=()) -> list[dict]:
    """Rows of `product(x, w, *rest)` forward and forward + backward (dx, dw from the cotangent dy);
    `gpu_kernels` those a row names where its program did not compile."""
    import jax

    def outputs(dy, x, w, *rest):
        y, pullback = jax.vjp(lambda x, w: product(x, w, *rest), x, w)
        return (y, *pullback(dy))

    forward = jax.jit(lambda dy, *a: product(*a))
    both = jax.jit(outputs)
    args = (dy, *args)  # the cotangent an argument, not a constant compiled in
    rows = []
    for pass_, jitted, count in (("fwd", forward, 1), ("fwd+bwd", both, 3)):
        ran = gpu_kernels
        try:
            fn, ran = compiled(jitted, *args)
            seconds = median(fn, *args)
            error = None
            if reference is not None:
                got = jax.block_until_ready(fn(*args))  # nothing queued behind it (pallas_calls)
                error = pass_error(pass_, got, reference[0], reference)
            rows.append(row(kernel, impl, pass_, shape, tflops=count * flops / seconds / 1e12, error=error,
                            seconds=seconds, gpu_kernels=ran))
        except Exception as exc:  # noqa: BLE001
            rows.append(failed(kernel, impl, pass_, shape, exc, ran))
    return rows


def _jax_versions(on_gpu: bool) -> dict:
    import jax
    import jaxlib

    found = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__}
    if on_gpu:
        from jlong.planner.targets import installed_cudnn_version

        cudnn = installed_cudnn_version()
        found["cudnn"] = ".".join(map(str, cudnn)) if cudnn else None
    return found


def _jax_device() -> dict:
    import jax

    device = jax.devices()[0]
    return {"platform": device.platform, "kind": device.device_kind}


# ---------------------------------------------------------------- the PyTorch part

def torch_part(quick: bool, workdir: Path) -> dict:
    import numpy as np
    import torch

    rows, versions = [], {"torch": torch.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    fla_note = None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        import fla

        versions["fla"] = getattr(fla, "__version__", "unknown")
        fla_note = _allow_flas_backward_on_this_triton()
    except ImportError as exc:
        chunk_gated_delta_rule, fla_missing = None, str(exc)
    _known_early(workdir / "torch", {"versions": versions})
    cuda = torch.device("cuda")
    median = torch_median_seconds

    for index, (label, B, T, Hk, H, D) in enumerate(gated_delta_shapes(quick)):
        shape = {"B": B, "T": T, "H": H, "Hk": Hk, "D": D, "label": label}
        if chunk_gated_delta_rule is None:
            rows += [row("gated_delta", "fla", p, shape, status="not run", note=fla_missing) for p in ("fwd", "fwd+bwd")]
            continue
        print(f"kernel_race: FLA at {shape}", flush=True)
        q, k, v, g, beta, do = torch_gated_delta_inputs(B, T, Hk, H, D, cuda)
        reference = np.load(workdir / "gated_delta_reference.npz") if index == 0 else None

        def forward():
            with torch.no_grad():
                return chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=False)[0]

        def both():
            o = chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=False)[0]
            return (o, *torch.autograd.grad(o, (q, k, v, g, beta), do))

        for pass_, fn in (("fwd", forward), ("fwd+bwd", both)):
            try:
                seconds = median(fn)
                error = None
                if reference is not None:
                    outputs = fn() if pass_ == "fwd+bwd" else (fn(),)
                    got = [t.detach().float().cpu().numpy() for t in outputs]
                    want = [reference[f"arr_{i}"] for i in range(6)]
                    error = pass_error(pass_, got[0] if pass_ == "fwd" else got[1:], want[0], want[1:])
                rows.append(row("gated_delta", "fla", pass_, shape, tokens_per_s=B * T / seconds, error=error,
                                seconds=seconds, note=fla_note if pass_ == "fwd+bwd" else None))
            except Exception as exc:  # noqa: BLE001
                rows.append(failed("gated_delta", "fla", pass_, shape, exc))
        del q, k, v, g, beta, do
        torch.cuda.empty_cache()

    for label, M, K, N, G, topk in grouped_shapes(quick):
        xb, wb, dyb = torch_grouped_inputs(M, K, N, G, cuda)
        for distribution in DISTRIBUTIONS:
            shape = {"M": M, "K": K, "N": N, "G": G, "k": topk, "label": label, "rows": distribution}
            sizes = group_sizes(M, G, distribution)
            offsets = torch_offsets(sizes, cuda)
            reference = _torch_grouped_reference(xb, wb, dyb, sizes)
            product = lambda: torch._grouped_mm(xb, wb, offs=offsets)  # noqa: E731
            rows += _torch_matmul_rows("grouped_matmul", product, (xb, wb), dyb, shape, 2.0 * M * K * N, reference,
                                       median)
        dense_w = wb[0].detach().clone().requires_grad_()
        rows += _torch_matmul_rows("dense_gemm", lambda: xb @ dense_w, (xb, dense_w), dyb,
                                   {"M": M, "K": K, "N": N, "label": label}, 2.0 * M * K * N, None, median)
        del xb, wb, dyb
        torch.cuda.empty_cache()
    return {"rows": rows, "versions": versions}


def torch_gated_delta_inputs(B: int, T: int, Hk: int, H: int, D: int, device) -> tuple:
    """`gated_delta_inputs` as PyTorch tensors on `device`: q, k, v and the cotangent bf16, g and beta float32,
    every input differentiable (FLA's dtypes)."""
    import torch

    q, k, v, g, beta, do = gated_delta_inputs(B, T, Hk, H, D)
    q, k, v = (torch.tensor(t, device=device).to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    g, beta = (torch.tensor(t, device=device).requires_grad_() for t in (g, beta))
    return q, k, v, g, beta, torch.tensor(do, device=device).to(torch.bfloat16)


def torch_grouped_inputs(M: int, K: int, N: int, G: int, device) -> tuple:
    """`grouped_inputs` as bf16 PyTorch tensors on `device`: x and w differentiable, w [G, K, N] stored as
    [G, N, K] and handed over transposed (the layout torchtitan gives torch._grouped_mm), and dy."""
    import torch

    x, w, dy = grouped_inputs(M, K, N, G)
    xb = torch.tensor(x, device=device).to(torch.bfloat16).requires_grad_()
    wb = torch.tensor(w, device=device).to(torch.bfloat16).transpose(-2, -1).contiguous().transpose(-2, -1)
    return xb, wb.requires_grad_(), torch.tensor(dy, device=device).to(torch.bfloat16)


def torch_offsets(sizes, device):
    """torch._grouped_mm's `offs`: where each group's rows end, int32."""
    import numpy as np
    import torch

    return torch.tensor(np.cumsum(sizes), device=device, dtype=torch.int32)


def torch_median_seconds(fn, warmups: int = 3) -> float:
    """Median seconds of fn() on the GPU over REPEATS calls (CUDA events, each call waited for), after
    `warmups` calls (FLA's autotuning happens in the first ones)."""
    import torch

    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _allow_flas_backward_on_this_triton() -> str | None:
    """FLA 0.6 refuses its gated backward on Hopper under Triton 3.4-3.7.0
    (its issue #640: wrong results from one kernel there). The race times it
    anyway, its error column showing whether it was wrong here; the note
    says so. None where FLA would have run it unasked."""
    from fla.ops.common import chunk_o

    if not (chunk_o.IS_NVIDIA_HOPPER and chunk_o.TRITON_ABOVE_3_4_0 and not chunk_o.TRITON_ABOVE_3_7_1):
        return None
    chunk_o.TRITON_ABOVE_3_7_1 = True
    return "FLA's refusal on this Triton (its #640) bypassed: see the error"


def _torch_grouped_reference(x, w, dy, sizes):
    import numpy as np
    import torch

    x, w, dy = (t.detach().float() for t in (x, w, dy))
    ys, dxs, dws, start = [], [], [], 0
    prior = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    for group, size in enumerate(sizes):
        rows = slice(start, start + int(size))
        ys.append((x[rows] @ w[group]).cpu().numpy())
        dxs.append((dy[rows] @ w[group].T).cpu().numpy())
        dws.append((x[rows].T @ dy[rows]).cpu().numpy())
        start += int(size)
    torch.backends.cuda.matmul.allow_tf32 = prior
    return np.concatenate(ys), np.concatenate(dxs), np.stack(dws)


def _torch_matmul_rows(kernel, product, leaves, dy, shape, flops, reference, median) -> list[dict]:
    import torch

    def forward():
        with torch.no_grad():
            return product()

    def both():
        y = product()
        return (y, *torch.autograd.grad(y, leaves, dy))

    rows = []
    for pass_, fn, count in (("fwd", forward, 1), ("fwd+bwd", both, 3)):
        try:
            seconds = median(fn)
            error = None
            if reference is not None:
                got = [t.detach().float().cpu().numpy() for t in (fn() if pass_ == "fwd+bwd" else (fn(),))]
                error = pass_error(pass_, got[0] if pass_ == "fwd" else got, reference[0], reference)
            rows.append(row(kernel, "torch", pass_, shape, tflops=count * flops / seconds / 1e12, error=error,
                            seconds=seconds))
        except Exception as exc:  # noqa: BLE001
            rows.append(failed(kernel, "torch", pass_, shape, exc))
    return rows


def not_run_torch_rows(reason: str) -> list[dict]:
    rows = []
    for label, B, T, Hk, H, D in GATED_DELTA_REHEARSAL:
        shape = {"B": B, "T": T, "H": H, "Hk": Hk, "D": D, "label": label}
        rows += [row("gated_delta", "fla", p, shape, status="not run", note=reason) for p in ("fwd", "fwd+bwd")]
    for label, M, K, N, G, topk in GROUPED_REHEARSAL:
        for distribution in DISTRIBUTIONS:
            shape = {"M": M, "K": K, "N": N, "G": G, "k": topk, "label": label, "rows": distribution}
            rows += [row("grouped_matmul", "torch", p, shape, status="not run", note=reason)
                     for p in ("fwd", "fwd+bwd")]
        rows += [row("dense_gemm", "torch", p, {"M": M, "K": K, "N": N, "label": label}, status="not run",
                     note=reason) for p in ("fwd", "fwd+bwd")]
    return rows


# ---------------------------------------------------------------- the parent: children, merge, report

def gpu_present() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return listed.returncode == 0 and "GPU" in listed.stdout


def run_child(part: str, args, workdir: Path, limit_s: float | None) -> dict:
    """The part's result; where it failed or ran out of time, the rows it had streamed, and a note."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    command = [sys.executable, str(HERE), "--part", part, "--workdir", str(workdir)]
    command += ["--rehearse"] * args.rehearse + ["--quick"] * args.quick
    command += ["--tiles", str(args.tiles.resolve())] if args.tiles else []
    try:
        returncode = subprocess.run(command, env=env, timeout=limit_s).returncode
    except subprocess.TimeoutExpired:
        returncode = f"stopped after {limit_s:.0f} s"
    out = workdir / f"{part}.json"
    if not returncode and out.is_file():
        return json.loads(out.read_text())
    stream = workdir / f"{part}.jsonl"
    rows = [json.loads(line) for line in stream.read_text().splitlines()] if stream.is_file() else []
    print(f"kernel_race: the {part} part did not finish ({returncode}); {len(rows)} rows kept", file=sys.stderr)
    early = workdir / f"{part}.early.json"
    known = {"versions": {}, "device": {}} | (json.loads(early.read_text()) if early.is_file() else {})
    return {"rows": rows, "rates": [], **known, "unfinished": f"{part}: {returncode}"}


def driver() -> dict:
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        name, version = (part.strip() for part in line.split(","))
        return {"name": name, "driver": version}
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: jlong's kernels interpreted, tiny shapes")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where kernel-race.json and .md go")
    parser.add_argument("--quick", action="store_true",
                        help="T = 8,192 and 32,768 of 16 heads, the first expert shape (a short device lease)")
    parser.add_argument("--part-limit", type=float, help="seconds each framework's part may run (default: none)")
    parser.add_argument("--tiles", type=Path,
                        help="a kernel_tiles.py report: jlong's kernels run at its fastest tiles (default: theirs)")
    parser.add_argument("--part", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        global STREAM
        STREAM = args.workdir / f"{args.part}.jsonl"
        result = (jax_part(args.rehearse, args.quick, args.workdir, args.tiles) if args.part == "jax" else
                  torch_part(args.quick, args.workdir))
        (args.workdir / f"{args.part}.json").write_text(json.dumps(result))
        return 0
    on_gpu = gpu_present()
    if not on_gpu and not args.rehearse:
        print("kernel_race needs a GPU (nvidia-smi finds none); --rehearse runs jlong's kernels on the CPU",
              file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        jax_result = run_child("jax", args, Path(workdir), args.part_limit)
        if args.rehearse:
            torch_result = {"rows": not_run_torch_rows("rehearsal: no GPU"), "versions": {}}
        else:
            torch_result = run_child("torch", args, Path(workdir), args.part_limit)
    report = {
        "device": {**jax_result["device"], **driver()},
        "versions": {**jax_result["versions"], **torch_result["versions"]},
        "rehearsal": args.rehearse,
        "commit": commit(),
        "date": today(),
        "command": " ".join(["python", "experiments/kernel_race.py", *(portable(a) for a in (argv or sys.argv[1:]))]),
        "seconds": round(time.time() - started, 1),
        "rows": jax_result["rows"] + torch_result["rows"],
        "rates": jax_result["rates"],
        "tiles": jax_result.get("tiles", {}),
        "unfinished": [r["unfinished"] for r in (jax_result, torch_result) if "unfinished" in r],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel-race.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "kernel-race.md").write_text(markdown(report))
    if not report["rehearsal"]:
        (args.out / kernel_runs.RECORD_NAME).write_text(json.dumps(runs_record(report), indent=1) + "\n")
    print(markdown(report))
    return 0


def runs_record(report: dict) -> dict:
    """The record of which of jlong's GPU kernels ran on this GPU (`jlong.kernel_runs`), from the rows."""
    return kernel_runs.record(report["rows"], lambda row: row.get("gpu_kernels", []), commit=report["commit"],
                              device=report["device"].get("name") or report["device"].get("kind"),
                              date=report["date"], race="kernel-race.json")


def produced_by(report: dict) -> str:
    """A GPU experiment's provenance line: its command, commit, date, seconds, device, driver and versions."""
    device = report["device"]
    return (f"Produced by `{report['command']}` at commit {report['commit'] or 'unknown'} on "
            f"{report.get('date') or '?'} in {report['seconds']} s on {device.get('name') or device.get('kind')} "
            f"(driver {device.get('driver', 'none')}); versions: "
            + ", ".join(f"{k} {v}" for k, v in report["versions"].items()) + ".")


def _key(r) -> tuple:
    shape = {k: v for k, v in r["shape"].items()}
    return r["kernel"], r["pass"], json.dumps(shape, sort_keys=True)


def markdown(report: dict) -> str:
    """The race as a table: each rate beside its anchor's in the same run (FLA for the gated delta rule,
    torch._grouped_mm for the grouped matmul) and beside the dense GEMM of equal FLOPs."""
    rows = report["rows"]
    anchors = {_key(r): r for r in rows if r["impl"] in ("fla", "torch") and r["status"] == "ok"}
    dense = {(r["pass"], r["shape"]["M"], r["shape"]["K"], r["shape"]["N"]): r for r in rows
             if r["kernel"] == "dense_gemm" and r["impl"] == "jax" and r["status"] == "ok"}
    table = []
    for r in rows:
        rate = r["tokens_per_s"] if r["kernel"] == "gated_delta" else r["tflops"]
        anchor = anchors.get(_key(r))
        anchor_rate = None if anchor is None else (anchor["tokens_per_s"] or anchor["tflops"])
        versus = f"{rate / anchor_rate:.2f}" if rate and anchor_rate and anchor is not r else ""
        same = dense.get((r["pass"], r["shape"].get("M"), r["shape"].get("K"), r["shape"].get("N")))
        versus_dense = (f"{rate / same['tflops']:.2f}" if same and rate and r["kernel"] == "grouped_matmul" else "")
        unit = "tokens/s" if r["kernel"] == "gated_delta" else "TFLOP/s"
        shape = ", ".join(f"{k}={v}" for k, v in r["shape"].items())
        error = "" if r["max_rel_error"] is None else f"{r['max_rel_error']:.1e}"
        shown = "" if rate is None else (f"{rate:,.0f} {unit}" if unit == "tokens/s" else f"{rate:.1f} {unit}")
        status = r["status"] + (f" ({r['note']})" if r["note"] else "")
        table.append([r["kernel"], r["impl"], r["pass"], shape, status, shown, error, versus, versus_dense])
    head = [
        "# Kernel race" + (" (rehearsal on the CPU: jlong's kernels interpreted, nothing timed means anything)"
                           if report["rehearsal"] else ""),
        "",
        produced_by(report),
        "",
        "Measured: medians of repeated calls after warm-up. `vs anchor` is the rate over FLA's (gated delta) or "
        "torch._grouped_mm's (grouped matmul) at the same shape and pass in this run; `vs dense` the grouped "
        "matmul's TFLOP/s over jax's dense GEMM of the same M, K, N. Errors: relative to the float32 reference's "
        "largest magnitude (gated delta: at the first length only).",
        "",
        markdown_table(["kernel", "impl", "pass", "shape", "status", "rate", "max rel. error", "vs anchor",
                        "vs dense"], table),
    ]
    if report["unfinished"]:
        head += ["", "Parts that did not finish (their rows above are those measured before): "
                 + "; ".join(report["unfinished"]) + "."]
    if report.get("tiles"):
        head += ["", "jlong's kernels ran at: " + "; ".join(
            f"{kernel} " + ", ".join(f"{k}={v}" for k, v in settings.items()) for kernel, settings in
            report["tiles"].items()) + "."]
    if not report["rehearsal"]:
        ran = sorted(kernel_runs.from_record(runs_record(report), kernel_runs.RECORD_NAME).kernels)
        head += ["", f"jlong's GPU kernels this run records as run on the GPU ({kernel_runs.RECORD_NAME}: `auto` "
                 "picks no others): " + (", ".join(ran) or "none") + "."]
    if report["rates"]:
        head += ["", "The gated delta rules' recurrence kernels alone (what the planner prices them at):", "",
                 markdown_table(["kernel", "seconds", "TFLOP/s", "share of bf16 peak"],
                                [[r["name"], f"{r['seconds']:.2e}", f"{r['tflops']:.1f}",
                                  f"{r['share_of_bf16_peak']:.4f}"] for r in report["rates"]])]
    return "\n".join(head) + "\n"


if __name__ == "__main__":
    sys.exit(main())
