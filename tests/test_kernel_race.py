"""experiments/kernel_race.py: without a GPU it refuses in one line; its CPU rehearsal runs jlong's side of the
race (the Triton and Mosaic GPU kernels interpreted) and writes the results in the form the GPU run does.
experiments/kernel_estimate.py prices the kernels deviceless; experiments/kernel_profile.py sums a trace's
kernels by name."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from helpers import H100, REPO, load_experiment, needs_gpu_compiler

SCRIPT = REPO / "experiments" / "kernel_race.py"


def run_script(*args, script=SCRIPT):
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)


@pytest.mark.parametrize("script", ["kernel_race", "kernel_profile"])
def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path, script):
    result = run_script("--out", str(tmp_path), script=REPO / "experiments" / f"{script}.py")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a GPU" in lines[0] and "--rehearse" in lines[0], result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_the_rehearsal_races_jlongs_kernels_and_marks_the_anchors_not_run(tmp_path):
    result = run_script("--rehearse", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "kernel-race.json").read_text())
    assert data["rehearsal"] and data["device"]["platform"] == "cpu" and data["versions"]["jax"]
    rows = data["rows"]
    ours = [r for r in rows if r["impl"].startswith("jlong:") or r["impl"] == "jax"]
    assert {(r["kernel"], r["impl"]) for r in ours} >= {("gated_delta", "jlong:triton"), ("gated_delta", "jlong:mosaic"),
                                                       ("gated_delta", "jlong:chunked"),
                                                       ("gated_delta", "jlong:triton_recurrence"),
                                                       ("grouped_matmul", "jlong:triton"), ("grouped_matmul", "jlong:mosaic"),
                                                       ("dense_gemm", "jax")}
    assert all(r["status"] == "ok" for r in ours) and {r["pass"] for r in ours} == {"fwd", "fwd+bwd"}
    # the numerics against float32 references: bf16 inputs, so within a few bf16 roundings
    errors = [r["max_rel_error"] for r in ours if r["max_rel_error"] is not None]
    assert errors and max(errors) < 2e-2
    anchors = [r for r in rows if r["impl"] in ("fla", "torch")]
    assert anchors and all(r["status"] == "not run" for r in anchors)
    assert "| gated_delta | jlong:triton | fwd+bwd |" in (tmp_path / "kernel-race.md").read_text()
    assert not (tmp_path / "kernel-runs.json").exists(), "interpreted on the CPU, no kernel ran on a GPU"


@pytest.mark.fast
def test_a_tile_reports_fastest_candidate_is_ranked_on_each_kernels_own_passes():
    """`kernel_race --tiles` runs each kernel at its fastest candidate that ran all of its own passes: the
    products' rows of a report that still timed the weight gradient among them are not dropped for the
    weight gradient's error, and a report without the weight gradient's section leaves its tiles alone."""
    best_settings = load_experiment("kernel_tiles").best_settings
    settings = lambda m, n: {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": 64, "NUM_WARPS": 8, "NUM_STAGES": 4}  # noqa: E731
    products = {"up forward": 1.0, "up dx": 1.0, "down forward": 1.0}
    report = {"grouped_matmul": {"results": [
        {**settings(128, 256), "up forward": 270.0, "up dx": 241.0, "up dw": None, "down forward": 254.0,
         "errors": ["up dw: RESOURCE_EXHAUSTED: Shared memory size limit exceeded"]},
        {**settings(64, 256), "up forward": 180.0, "up dx": 180.0, "up dw": 163.0, "down forward": 185.0},
        {**settings(64, 128), **products, "errors": ["down forward: failed"], "down forward": None},
    ]}, "grouped_matmul_weight_gradient": {"results": [
        {"WGRAD_BLOCK_M": 64, "up dw": 150.0}, {"WGRAD_BLOCK_M": 128, "up dw": 190.0},
    ]}}
    assert best_settings(report, "grouped_matmul") == settings(128, 256)
    assert best_settings(report, "grouped_matmul_weight_gradient") == {"WGRAD_BLOCK_M": 128}
    report["grouped_matmul"]["results"] = report["grouped_matmul"]["results"][2:]
    assert best_settings(report, "grouped_matmul") == {}


@pytest.mark.fast
def test_pytorchs_inputs_are_the_races_inputs_in_flas_and_grouped_mms_dtypes_and_layouts():
    """What the race and the profile hand FLA and torch._grouped_mm (on the CPU here, the GPU there): the
    inputs jax gets, rounded alike; differentiable where gradients are timed; w stored [G, N, K]."""
    import numpy as np
    import torch

    race = load_experiment("kernel_race")
    q, k, v, g, beta, do = race.torch_gated_delta_inputs(1, 64, 2, 4, 16, "cpu")
    bf16, f32 = (torch.bfloat16, jnp.bfloat16), (torch.float32, jnp.float32)
    for got, wanted, (dtype, rounded) in zip((q, k, v, g, beta, do), race.gated_delta_inputs(1, 64, 2, 4, 16),
                                             [bf16] * 3 + [f32] * 2 + [bf16]):
        assert got.dtype == dtype and tuple(got.shape) == wanted.shape
        np.testing.assert_array_equal(got.detach().float().numpy(), np.asarray(jnp.asarray(wanted, rounded)))
    assert all(t.requires_grad for t in (q, k, v, g, beta)) and not do.requires_grad
    x, w, dy = race.torch_grouped_inputs(96, 32, 16, 4, "cpu")
    assert (x.dtype, w.dtype, dy.dtype) == (torch.bfloat16,) * 3 and x.requires_grad and w.requires_grad
    assert tuple(w.shape) == (4, 32, 16) and w.stride() == (32 * 16, 1, 32)  # [G, N, K] in memory
    np.testing.assert_array_equal(w.detach().float().numpy(),
                                  np.asarray(jnp.asarray(race.grouped_inputs(96, 32, 16, 4)[1], jnp.bfloat16)))
    sizes = race.group_sizes(96, 4, "skewed")
    assert race.torch_offsets(sizes, "cpu").tolist() == list(np.cumsum(sizes)) and sum(sizes) == 96


@needs_gpu_compiler
def test_the_deviceless_estimate_prices_the_kernels_and_names_the_heaviest_operations():
    """experiments/kernel_estimate.py at a small shape: the Triton rule's programs compile for an H100, are
    priced with their kernels' calls among the costs, and list their heaviest operations by bytes moved."""
    estimate = load_experiment("kernel_estimate")
    device = H100.devices(1)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    programs = estimate.gated_delta(256, 2, spec)
    for text in programs.values():
        cost = estimate.priced(text, 256)
        assert cost["ms"] > 0 and cost["by_kind"]["gated delta"] > 0 and cost["hbm_gb"] > 0
        heaviest = estimate.heaviest(text, 5)
        assert len(heaviest) == 5 and float(heaviest[0][0]) >= float(heaviest[-1][0])
    assert "gated_delta_backward" in programs["fwd+bwd"] and "gated_delta_backward" not in programs["fwd"]


@pytest.mark.fast
def test_a_profile_sums_each_kernels_launches_per_call_and_splits_the_time_by_what_the_names_say():
    profile = load_experiment("kernel_profile")
    durations = {  # ns per launch, over two calls
        "gated_delta_forward": [4e6, 4e6], "gated_delta_backward": [6e6, 6e6],
        "sm90_xmma_gemm_bf16bf16_bf16f32": [1e6] * 4, "loop_multiply_fusion_3": [0.5e6] * 8,
    }
    found = profile.summary(durations, calls=2, wall_s=0.02)
    assert found["kernel_ms"] == pytest.approx(4 + 6 + 2 + 2) and found["launches"] == 1 + 1 + 2 + 4
    assert found["busy"] == pytest.approx(14 / 20)
    assert found["categories"] == pytest.approx({"jlong's Pallas kernels": 10, "GEMMs": 2,
                                                 "fusions and other kernels": 2})
    assert [t["name"] for t in found["top"][:2]] == ["gated_delta_backward", "gated_delta_forward"]
    assert sum(t["share"] for t in found["top"]) == pytest.approx(1)
    for name in ("chunk_terms_forward", "chunk_terms_backward"):  # not FLA's chunk_* kernels
        assert profile.category(name) == "jlong's Pallas kernels"
    assert profile.category("chunk_gated_delta_rule_fwd_kernel_h") == "FLA's Triton kernels"


@pytest.mark.fast
def test_a_jax_trace_on_the_cpu_gives_each_xla_operation_once_per_call(tmp_path):
    profile = load_experiment("kernel_profile")
    step = jax.jit(lambda x: jnp.sin(x) @ x)
    x = jnp.ones((64, 64))
    jax.block_until_ready(step(x))
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(3):
            jax.block_until_ready(step(x))
    durations = profile.xla_kernel_durations(str(tmp_path), on_gpu=False)
    assert durations and all(len(times) == 3 and min(times) > 0 for times in durations.values()), durations


@pytest.mark.slow  # an experiment rehearsed end to end: the long tier
def test_the_profile_rehearsal_lists_each_cases_operations(tmp_path):
    result = run_script("--rehearse", "--out", str(tmp_path), script=REPO / "experiments" / "kernel_profile.py")
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "kernel-profile.json").read_text())
    assert data["rehearsal"] and data["device"]["platform"] == "cpu"
    cases = {(c["kernel"], c["impl"]): c for c in data["cases"]}
    assert set(cases) == {("gated_delta", "jlong:triton"), ("gated_delta", "jlong:mosaic"),
                          ("grouped_matmul", "jlong:triton"), ("grouped_matmul", "jlong:mosaic"), ("dense_gemm", "jax")}
    assert all(c["status"] == "ok" and c["top"] and c["launches"] > 0 for c in cases.values())
    assert "## gated_delta, jlong:triton" in (tmp_path / "kernel-profile.md").read_text()
