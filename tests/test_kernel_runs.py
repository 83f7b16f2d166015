"""Kernels no GPU has run: `auto` picks a GPU kernel only once a race recorded it running on a GPU
(`jlong.kernel_runs`, the record experiments/kernel_race.py writes beside its results), and the planner prices a
kernel that has not run at a measured sibling's rate and names it in the plan."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from helpers import H100, REPO, load_experiment, needs_gpu_compiler

from jlong import kernel_runs
from jlong.kernel_runs import KernelRuns
from jlong.linear_attention import gated_delta
from jlong.moe import grouped_matmul
from jlong.ops.pallas_calls import TRITON_CALL, has_pallas_triton
from jlong.planner import pricing
from jlong.planner.cost_report import format_cost
from jlong.planner.hlo import parse_module
from jlong.planner.step_cost import Efficiency, estimate
from jlong.planner.targets import GPUS

pytestmark = pytest.mark.skipif(not has_pallas_triton(), reason="this jax has no Pallas Triton backend")
RESULTS = REPO / "experiments" / "results"


def ran(*registry_entries) -> KernelRuns:
    """A record in which the GPU kernels of these (registry, name) entries ran."""
    return KernelRuns(frozenset(n for registry, name in registry_entries for n in registry.GPU_KERNEL_NAMES[name]))


@pytest.mark.fast
@pytest.mark.parametrize("runs, expected", [
    (KernelRuns(), "chunked"),  # nothing recorded: XLA's
    (ran((gated_delta, "triton_recurrence")), "triton_recurrence"),
    (ran((gated_delta, "mosaic")), "mosaic"),
    (ran((gated_delta, "triton_recurrence"), (gated_delta, "mosaic")), "triton_recurrence"),
    (ran((gated_delta, "triton")), "triton"),
], ids=["none", "recurrence", "mosaic", "recurrence-and-mosaic", "all-triton"])
def test_auto_picks_a_gated_delta_rule_on_a_gpu_only_once_its_kernels_ran_on_one(runs, expected):
    assert gated_delta.kernel_for("gpu", runs) == expected
    assert gated_delta.kernel_for("cpu", runs) == "chunked"


@pytest.mark.fast
def test_the_full_triton_rule_is_not_picked_while_one_of_its_kernels_has_not_run():
    names = set(gated_delta.GPU_KERNEL_NAMES["triton"])
    for missing in names - set(gated_delta.GPU_KERNEL_NAMES["triton_recurrence"]):
        assert gated_delta.kernel_for("gpu", KernelRuns(frozenset(names - {missing}))) == "triton_recurrence"


@pytest.mark.fast
@pytest.mark.parametrize("runs, expected", [
    (KernelRuns(), "ragged_dot"), (ran((grouped_matmul, "mosaic")), "mosaic"),
    (ran((grouped_matmul, "triton"), (grouped_matmul, "mosaic")), "triton"),
], ids=["none", "mosaic", "both"])
def test_auto_picks_a_grouped_matmul_on_a_gpu_only_once_its_kernels_ran_on_one(runs, expected):
    assert grouped_matmul.kernel_for("gpu", runs) == expected
    assert grouped_matmul.kernel_for("cpu", runs) == "ragged_dot"


@pytest.mark.fast
def test_the_committed_record_is_the_h200_race_of_b6e22e7_and_auto_runs_what_it_ran():
    """Derived from kernel-race.json's rows: each kernel it names ran in rows of that race that came out ok;
    at b6e22e7 the Triton rule was the recurrence kernels alone, the grouped matmul the Triton kernels."""
    runs = kernel_runs.recorded()
    record = json.loads((RESULTS / kernel_runs.RECORD_NAME).read_text())
    race = json.loads((RESULTS / record["race"]).read_text())
    assert (runs.commit, record["commit"]) == ("b6e22e7", race["commit"])
    assert runs.kernels == {"gated_delta_forward", "gated_delta_backward", "grouped_matmul",
                            "grouped_matmul_weight_gradient"}
    assert runs.kernels <= pricing.GPU_KERNEL_NAMES
    ok_rows = {(r["kernel"], r["impl"], r["pass"]) for r in race["rows"] if r["status"] == "ok"}
    for rows in record["kernels"].values():
        assert {tuple(label.split(" ", 3)[:3]) for label in rows["ok"]} <= ok_rows
    assert gated_delta.kernel_for("gpu") == "triton_recurrence" and grouped_matmul.kernel_for("gpu") == "triton"


@pytest.mark.fast
def test_a_kernel_counts_as_run_only_if_no_row_that_ran_it_failed():
    shape = {"T": 64}
    rows = [{"kernel": "k", "impl": "jlong:a", "pass": "fwd", "shape": shape, "status": "ok"},
            {"kernel": "k", "impl": "jlong:b", "pass": "fwd", "shape": shape, "status": "ok"},
            {"kernel": "k", "impl": "jlong:b", "pass": "fwd+bwd", "shape": shape, "status": "failed"},
            {"kernel": "k", "impl": "jlong:c", "pass": "fwd", "shape": shape, "status": "not run"}]
    names = {"jlong:a": ["a"], "jlong:b": ["b", "b_grad"], "jlong:c": ["c"]}
    record = kernel_runs.record(rows, lambda row: names[row["impl"]], commit="abc1234", device="GPU", date="d",
                                race="kernel-race.json")
    assert sorted(record["kernels"]) == ["a", "b", "b_grad"]
    assert kernel_runs.from_record(json.loads(json.dumps(record)), "test").kernels == {"a"}


# A loop of 3 trips calling two Triton kernels of the gated delta rule: the recurrence's forward (raced at
# b6e22e7) and the outputs' (never run on a GPU), at BH 8, 4 chunks of 64, widths 128.
KERNEL_CALLS = """
HloModule calls, is_scheduled=true

%body (param: (s32[], bf16[8,4,64,128])) -> (s32[], bf16[8,4,64,128]) {
  %param = (s32[], bf16[8,4,64,128]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = bf16[8,4,64,128]{3,2,1,0} get-tuple-element(%param), index=1
  %c = bf16[8,4,64,64]{3,2,1,0} constant({...})
  %s = bf16[8,4,128,128]{3,2,1,0} constant({...})
  %state = bf16[8,4,64,128]{3,2,1,0} custom-call(%x, %x), custom_call_target="TRITON", backend_config={grid_x = 1 : i32, name = "gated_delta_forward", num_stages = 3}
  %o = bf16[8,4,64,128]{3,2,1,0} custom-call(%x, %c, %s, %state), custom_call_target="TRITON", backend_config={grid_x = 1 : i32, name = "gated_delta_outputs", num_stages = 3}
  %next = s32[] add(%i, %i)
  ROOT %out = (s32[], bf16[8,4,64,128]{3,2,1,0}) tuple(%next, %o)
}

%cond (param.1: (s32[], bf16[8,4,64,128])) -> pred[] {
  %param.1 = (s32[], bf16[8,4,64,128]{3,2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x: bf16[8,4,64,128]) -> bf16[8,4,64,128] {
  %x.1 = bf16[8,4,64,128]{3,2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,4,64,128]{3,2,1,0}) tuple(%zero, %x.1)
  %loop = (s32[], bf16[8,4,64,128]{3,2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %result = bf16[8,4,64,128]{3,2,1,0} get-tuple-element(%loop), index=1
}
""".replace("TRITON", TRITON_CALL)


def priced(runs: KernelRuns, efficiency: Efficiency = Efficiency(), gpu=GPUS["h100"]):
    return estimate(parse_module(KERNEL_CALLS), gpu=gpu, efficiency=efficiency, node_of=[0], tokens_per_step=1,
                    model_flops_per_device=1.0, runs=runs)


@pytest.mark.fast
def test_the_plan_names_each_kernel_priced_without_a_measurement_with_its_calls():
    cost = priced(kernel_runs.recorded())
    assert cost.unmeasured_kernels == {"gated_delta_outputs": {"calls": 3, "priced_as": "gated delta outputs"}}
    report = format_cost(cost)
    assert "never run on a GPU" in report and "gated_delta_outputs x 3 (as gated delta outputs, 0.23)" in report
    assert "gated_delta_forward" not in report
    assert cost.as_dict()["unmeasured_kernels"] == cost.unmeasured_kernels  # jlong plan --json
    every_kernel_ran = ran((gated_delta, "triton"))
    assert priced(every_kernel_ran).unmeasured_kernels == {}
    assert "never run" not in format_cost(priced(every_kernel_ran))


@pytest.mark.fast
def test_a_kernel_never_run_is_priced_at_its_siblings_measured_rate_not_a_gemms():
    """On a GPU whose memory is never the bound, the outputs' calls take their FLOPs at the grouped matmul's
    measured share of the peak; the chunk terms' are at the recurrence kernels'."""
    eff, gpu = Efficiency(launch_us=0.0), dataclasses.replace(GPUS["h100"], hbm_bytes_per_s=1e18)
    cost = priced(kernel_runs.recorded(), eff, gpu)
    flops = 3 * 8 * 4 * 128 * 2 * 64 * (128 + 64)  # 3 calls of 2 C (dk + C) a chunk and value column
    assert eff.gated_delta_outputs == eff.grouped_matmul < eff.gemm
    assert cost.time_by_kind["gated delta outputs"] == pytest.approx(flops / (gpu.peak_bf16_flops * eff.grouped_matmul))
    assert eff.gated_delta_chunk_terms == eff.gated_delta


@pytest.mark.fast
def test_the_race_records_on_a_gpu_the_kernels_its_rows_ran_and_says_which():
    race = load_experiment("kernel_race")
    shape = {"T": 64}
    rows = [race.row("gated_delta", "jlong:triton_recurrence", "fwd+bwd", shape,
                     gpu_kernels={"gated_delta_forward", "gated_delta_backward"}),
            race.row("gated_delta", "jlong:triton", "fwd+bwd", shape, status="failed",
                     gpu_kernels=gated_delta.GPU_KERNEL_NAMES["triton"]),
            race.row("grouped_matmul", "torch", "fwd", shape)]
    report = {"rows": rows, "rehearsal": False, "commit": "abc1234", "date": "2026-12-01", "device": {"name": "GPU"},
              "versions": {}, "command": "python experiments/kernel_race.py", "seconds": 1.0, "unfinished": [],
              "rates": []}
    record = race.runs_record(report)
    assert (record["commit"], record["device"], record["race"]) == ("abc1234", "GPU", "kernel-race.json")
    assert kernel_runs.from_record(record, "test").kernels == set()  # the failed row ran both recurrence kernels
    rows[1]["status"] = "ok"
    assert kernel_runs.from_record(race.runs_record(report), "test").ran(gated_delta.GPU_KERNEL_NAMES["triton"])
    assert "records as run on the GPU (kernel-runs.json: `auto` picks no others): chunk_terms_backward, " in \
        race.markdown(report)


@needs_gpu_compiler
@pytest.mark.fast
def test_the_race_reads_the_gpu_kernels_a_row_ran_from_its_compiled_program():
    race = load_experiment("kernel_race")
    sharding = jax.sharding.SingleDeviceSharding(H100.devices(1)[0])
    x, w = (jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding) for shape in ((256, 64), (2, 64, 64)))
    sizes = jax.ShapeDtypeStruct((2,), jnp.int32, sharding=sharding)
    product = grouped_matmul.matmul("triton")
    _, forward = race.compiled(jax.jit(product), x, w, sizes)
    _, both = race.compiled(jax.jit(jax.grad(lambda x, w, s: product(x, w, s).astype(jnp.float32).sum(), (0, 1))),
                            x, w, sizes)
    assert forward == {"grouped_matmul"} and both == {"grouped_matmul", "grouped_matmul_weight_gradient"}
