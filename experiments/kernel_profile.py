"""Where the race's time goes, kernel by kernel, on one GPU: each case's
forward + backward traced by its framework's profiler (jax's for jlong's
kernels and the dense GEMM, PyTorch's for FLA and `torch._grouped_mm`), its
GPU kernels summed by name, so a kernel that falls short of its anchor in
`kernel_race.py` says where: its own Pallas kernels, the GEMMs XLA or
cuBLAS runs around them, or everything else (fusions, copies, launches).

    python experiments/kernel_profile.py [--out DIR]           # one GPU, about a minute
    python experiments/kernel_profile.py --rehearse --out DIR  # the CPU: tiny shapes, XLA:CPU's operations

Cases (bf16, the race's inputs): the gated delta rule at 32,768 tokens of
16 heads of 128 (jlong's Triton and Mosaic GPU rules, FLA's), the grouped matmul at
Qwen3-30B-A3B's gate/up shape with rows spread evenly (jlong's Triton and
Mosaic GPU kernels, `torch._grouped_mm`) and jax's dense GEMM of equal
FLOPs. Each is timed as the race times it (medians of calls each waited
for, after warm-up and FLA's autotuning), then traced over `CALLS` calls. The
profilers read CUPTI, which a gVisor machine may refuse: a case without
kernel events says so. For one kernel's counters (occupancy, throughput),
`ncu --clock-control none -k regex:NAME` on a Firecracker machine.

Writes `kernel-profile.json` and `kernel-profile.md` in DIR (default
experiments/results). jax and PyTorch run in child processes of their own.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

import kernel_race as race  # noqa: E402  (its inputs, shapes, references and GPU check)
from common import RESULTS, commit, markdown_table, median_seconds, portable, today  # noqa: E402

CALLS = 3  # traced calls per case
PART_LIMIT_S = 240  # each framework's part, compiles and autotuning included (a minute expected)
TOP = 12  # kernels listed per case
GATED_DELTA = ("16 heads", 1, 32_768, 16, 16, 128)
GROUPED = race.GROUPED_SHAPES[0]
# What a kernel's name says it is, first match wins (the rest: XLA's fusions and PyTorch's elementwise kernels).
CATEGORIES = [
    # jlong's kernel names from their start (FLA's chunk_gated_delta_rule_* kernels are FLA's)
    ("jlong's Pallas kernels", re.compile(r"\b(gated_delta|grouped_matmul|chunk_terms)|mosaic", re.I)),
    ("FLA's Triton kernels", re.compile(r"chunk_|fwd_kernel|bwd_kernel|_kkt|solve_tril|wy_", re.I)),
    ("GEMMs", re.compile(r"gemm|cutlass|cublas|xmma|nvjet|sm90_|wgmma|matmul|triton_dot|_mm_", re.I)),
    ("copies", re.compile(r"memcpy|memset|copy", re.I)),
]
OTHER = "fusions and other kernels"


def category(kernel: str) -> str:
    return next((name for name, pattern in CATEGORIES if pattern.search(kernel)), OTHER)


def summary(durations_ns: dict[str, list[float]], calls: int, wall_s: float) -> dict:
    """A case's kernels, {name: [duration of each launch, ns]} over `calls` calls, per call: GPU time, launches,
    the share of the wall time the GPU was busy, time by category and the `TOP` kernels by time."""
    per_call = {name: (sum(times) / calls / 1e6, len(times) / calls) for name, times in durations_ns.items()}
    kernel_ms = sum(ms for ms, _ in per_call.values())
    by_category = collections.Counter()
    for name, (ms, _) in per_call.items():
        by_category[category(name)] += ms
    top = sorted(per_call.items(), key=lambda item: -item[1][0])[:TOP]
    return {
        "wall_ms": wall_s * 1e3,
        "kernel_ms": kernel_ms,
        "launches": sum(n for _, n in per_call.values()),
        "busy": kernel_ms / (wall_s * 1e3) if wall_s else None,
        "categories": {name: ms for name, ms in by_category.most_common()},
        "top": [{"name": name, "ms": ms, "launches": n, "share": ms / kernel_ms if kernel_ms else None}
                for name, (ms, n) in top],
    }


def xla_kernel_durations(trace_dir: str, on_gpu: bool) -> dict[str, list[float]]:
    """{kernel name: [ns, ...]} of a jax trace: on a GPU its streams' kernels (none where CUPTI recorded
    none), on the CPU the host's XLA operations (the events that name their HLO operation)."""
    import jax

    [path] = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(path)  # held: its planes are views into it
    durations = collections.defaultdict(list)
    for plane in profile.planes:
        if not (plane.name.startswith("/device:GPU") if on_gpu else plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            if on_gpu and not line.name.startswith("Stream"):
                continue  # the GPU's derived lines (modules, operations) repeat its streams' kernels
            for event in line.events:
                if on_gpu or any(key == "hlo_op" for key, _ in event.stats):
                    durations[event.name].append(event.duration_ns)
    return durations


def jax_cases(rehearse: bool) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jlong.linear_attention import gated_delta_mosaic, gated_delta_triton
    from jlong.moe import grouped_matmul_mosaic, grouped_matmul_triton

    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not rehearse:  # a GPU without jax's CUDA plugin: the shapes would run interpreted
        print(f"kernel_profile: jax runs on {jax.default_backend()}, not the GPU: install its CUDA plugin",
              file=sys.stderr)
        raise SystemExit(2)
    interpret = not on_gpu
    label, B, T, Hk, H, D = race.GATED_DELTA_REHEARSAL[0] if rehearse else GATED_DELTA
    q, k, v, g, beta, do = race.gated_delta_inputs(B, T, Hk, H, D)
    inputs = [jnp.asarray(t, jnp.bfloat16) for t in (q, k, v)] + [jnp.asarray(g), jnp.asarray(beta)]
    shape = {"B": B, "T": T, "H": H, "Hk": Hk, "D": D, "label": label}
    cases = []
    for impl, module_rule in (("jlong:triton", gated_delta_triton.triton), ("jlong:mosaic", gated_delta_mosaic.mosaic)):
        rule = functools.partial(module_rule, interpret=interpret)
        cases.append(("gated_delta", impl, shape, jax.jit(lambda *a, rule=rule: race._gated_delta_outputs(
            rule, a[:5], a[5])), (*inputs, jnp.asarray(do, jnp.bfloat16))))
    label, M, K, N, G, _ = race.GROUPED_REHEARSAL[0] if rehearse else GROUPED
    x, w, dy = (jnp.asarray(t, jnp.bfloat16) for t in race.grouped_inputs(M, K, N, G))
    sizes = jnp.asarray(race.group_sizes(M, G, "uniform"))
    shape = {"M": M, "K": K, "N": N, "G": G, "label": label, "rows": "uniform"}
    for impl, module in (("jlong:triton", grouped_matmul_triton), ("jlong:mosaic", grouped_matmul_mosaic)):
        product = functools.partial(module.grouped_matmul, group_sizes_G=sizes, interpret=interpret)
        cases.append(("grouped_matmul", impl, shape, jax.jit(_with_gradients(product)), (dy, x, w)))
    cases.append(("dense_gemm", "jax", {"M": M, "K": K, "N": N, "label": label},
                  jax.jit(_with_gradients(lambda x, w: x @ w)), (dy, x, w[0])))

    results = []
    for kernel, impl, shape, fn, args in cases:
        print(f"kernel_profile: {kernel} {impl} at {shape}", flush=True)
        try:
            wall = median_seconds(fn, *args, repeats=1 if rehearse else race.REPEATS)
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir):
                    for _ in range(CALLS):
                        jax.block_until_ready(fn(*args))
                durations = xla_kernel_durations(trace_dir, on_gpu)
            results.append(_case(kernel, impl, shape, durations, wall))
        except Exception as exc:  # noqa: BLE001 (a failing case is a row; the others go on)
            results.append(_failed(kernel, impl, shape, exc))
    return results


def _with_gradients(product):
    """(dy, x, w) -> (y, dx, dw) of y = product(x, w) with cotangent dy."""
    import jax

    def outputs(dy, x, w):
        y, pullback = jax.vjp(product, x, w)
        return (y, *pullback(dy))

    return outputs


def torch_cases() -> tuple[list[dict], dict]:
    """The PyTorch cases, and the versions they ran on."""
    import torch

    versions = {"torch": torch.__version__}
    cuda = torch.device("cuda")
    cases = []
    label, B, T, Hk, H, D = GATED_DELTA
    shape = {"B": B, "T": T, "H": H, "Hk": Hk, "D": D, "label": label}
    try:
        import fla
        import triton
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        versions |= {"triton": triton.__version__, "fla": getattr(fla, "__version__", "unknown")}
        note = race._allow_flas_backward_on_this_triton()
        q, k, v, g, beta, do = race.torch_gated_delta_inputs(B, T, Hk, H, D, cuda)

        def fla_rule():
            o = chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, use_qk_l2norm_in_kernel=False)[0]
            return torch.autograd.grad(o, (q, k, v, g, beta), do)

        cases.append(("gated_delta", "fla", shape, fla_rule, note))
    except Exception as exc:  # noqa: BLE001 (FLA missing, or its inputs failed: a row, the others go on)
        cases.append(("gated_delta", "fla", shape, exc, None))
    label, M, K, N, G, _ = GROUPED
    shape = {"M": M, "K": K, "N": N, "G": G, "label": label, "rows": "uniform"}
    try:
        xb, wb, dyb = race.torch_grouped_inputs(M, K, N, G, cuda)
        offsets = race.torch_offsets(race.group_sizes(M, G, "uniform"), cuda)

        def grouped():
            y = torch._grouped_mm(xb, wb, offs=offsets)
            return torch.autograd.grad(y, (xb, wb), dyb)

        cases.append(("grouped_matmul", "torch", shape, grouped, None))
    except Exception as exc:  # noqa: BLE001
        cases.append(("grouped_matmul", "torch", shape, exc, None))

    results = []
    for kernel, impl, shape, fn, note in cases:
        if isinstance(fn, Exception):
            results.append({**_failed(kernel, impl, shape, fn),
                            "status": "not run" if isinstance(fn, ImportError) else "failed"})
            continue
        print(f"kernel_profile: {kernel} {impl} at {shape}", flush=True)
        try:
            wall = race.torch_median_seconds(fn)  # after FLA's autotuning in the warm-up calls
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
                for _ in range(CALLS):
                    fn()
                torch.cuda.synchronize()
            durations = collections.defaultdict(list)
            for event in profiler.events():
                if event.device_type == torch.autograd.DeviceType.CUDA and not event.is_user_annotation:
                    durations[event.name].append(event.time_range.elapsed_us() * 1e3)
            results.append({**_case(kernel, impl, shape, durations, wall), **({"note": note} if note else {})})
        except Exception as exc:  # noqa: BLE001
            results.append(_failed(kernel, impl, shape, exc))
    return results, versions


def _case(kernel, impl, shape, durations, wall_s) -> dict:
    found = summary(durations, CALLS, wall_s) if durations else {"wall_ms": wall_s * 1e3}
    note = None if durations else "no kernel events: the profiler read none (CUPTI refused on this machine?)"
    return {"kernel": kernel, "impl": impl, "shape": shape, "status": "ok", "note": note, **found}


def _failed(kernel, impl, shape, exc) -> dict:
    return {"kernel": kernel, "impl": impl, "shape": shape, "status": "failed",
            "note": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}


def markdown(report: dict) -> str:
    lines = [
        "# Kernel profile" + (" (rehearsal on the CPU: XLA:CPU's operations, interpreted kernels; no GPU's times)"
                              if report["rehearsal"] else ""),
        "",
        race.produced_by(report),
        "",
        f"Measured: forward + backward. Wall: median of repeated calls, untraced. GPU time and launches: per call, "
        f"summed over {CALLS} traced calls' kernels; busy = GPU time / wall."
        + (" Here the 'kernels' are XLA:CPU's operations, a loop's time counted again in the operations inside it."
           if report["rehearsal"] else ""),
    ]
    for case in report["cases"]:
        shape = ", ".join(f"{k}={v}" for k, v in case["shape"].items())
        lines += ["", f"## {case['kernel']}, {case['impl']} ({shape})", ""]
        if case["status"] != "ok" or "top" not in case:
            lines.append(f"{case['status']}: {case['note']}" + (f" (wall {case['wall_ms']:.2f} ms)"
                                                                 if "wall_ms" in case else ""))
            continue
        split = "; ".join(f"{name} {ms:.3f} ms" for name, ms in case["categories"].items())
        lines += [f"Wall {case['wall_ms']:.3f} ms; GPU {case['kernel_ms']:.3f} ms in {case['launches']:,.0f} "
                  f"launches (busy {case['busy']:.2f}): {split}.", ""]
        lines.append(markdown_table(["kernel", "ms per call", "launches per call", "share of GPU time"], [
            [f"`{t['name'][:90]}`", f"{t['ms']:.3f}", f"{t['launches']:g}", f"{t['share']:.3f}"]
            for t in case["top"]]))
    return "\n".join(lines) + "\n"


def _child(part: str, rehearse: bool, workdir: Path) -> None:
    if part == "jax":
        import jax

        found = {"cases": jax_cases(rehearse), "versions": race._jax_versions(jax.default_backend() == "gpu"),
                 "device": race._jax_device()}
    else:
        cases, versions = torch_cases()
        found = {"cases": cases, "versions": versions}
    (workdir / f"{part}.json").write_text(json.dumps(found))


def _run_child(part: str, rehearse: bool, workdir: Path) -> dict:
    command = [sys.executable, str(HERE), "--part", part, "--workdir", str(workdir)] + ["--rehearse"] * rehearse
    try:
        returncode = subprocess.run(command, env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
                                    timeout=PART_LIMIT_S).returncode
    except subprocess.TimeoutExpired:
        returncode = f"stopped after {PART_LIMIT_S} s"
    out = workdir / f"{part}.json"
    if returncode == 0 and out.is_file():
        return json.loads(out.read_text())
    return {"cases": [{"kernel": part, "impl": part, "shape": {}, "status": "failed",
                       "note": f"the {part} part did not finish ({returncode})"}], "versions": {}, "device": {}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="on the CPU: tiny shapes, interpreted kernels")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where kernel-profile.json and .md go")
    parser.add_argument("--part", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        _child(args.part, args.rehearse, args.workdir)
        return 0
    if not args.rehearse and not race.gpu_present():
        print("kernel_profile needs a GPU (nvidia-smi finds none); --rehearse profiles the CPU's run",
              file=sys.stderr)
        return 2
    started = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        found = _run_child("jax", args.rehearse, Path(workdir))
        torch_found = {"cases": [], "versions": {}} if args.rehearse else _run_child("torch", False, Path(workdir))
    report = {
        "device": {**found["device"], **race.driver()},
        "versions": {**found["versions"], **torch_found["versions"]},
        "rehearsal": args.rehearse,
        "commit": commit(),
        "date": today(),
        "command": " ".join(["python", "experiments/kernel_profile.py",
                             *(portable(a) for a in (sys.argv[1:] if argv is None else argv))]),
        "seconds": round(time.time() - started, 1),
        "cases": found["cases"] + torch_found["cases"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel-profile.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "kernel-profile.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
