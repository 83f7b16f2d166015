"""The step cost read from a compiled program: counts checked against programs
whose FLOPs, collective bytes, host bytes and launches are known by hand,
the roofline's overlap rule, and the recompute that `offload_attention` cuts
in the real XLA:GPU program."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jlong.planner.hlo import parse_module
from jlong.planner.memory import offloaded_attention_bytes, plan_of, saved_layer_input_bytes
from jlong.planner.cost_report import format_cost
from jlong.planner.step_cost import COST_KEYS, Efficiency, cost_dict, estimate, step_cost
from jlong.planner.targets import GPUS, gpu_devices
from helpers import WHOLE_STACK, assert_one_line_error, compiled_step, needs_gpu_compiler, run_cli, whole_stack

H100_GPU = GPUS["h100"]

# A hand-written scheduled module: a gemm; a loop of 3 trips whose body
# all-gathers over half-node groups while a fusion multiplies and adds; a
# collective-permute between two nodes (16 devices, 8 per node); a copy to
# host memory; one causal cuDNN attention forward.
MODULE = """
HloModule hand, is_scheduled=true

%gemm_computation (p0: bf16[128,256], p1: bf16[256,512]) -> bf16[128,512] {
  %p0 = bf16[128,256]{1,0} parameter(0)
  %p1 = bf16[256,512]{1,0} parameter(1)
  ROOT %dot = bf16[128,512]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%multiply_add (a: f32[1024], b: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %m = f32[1024]{0} multiply(%a, %b)
  ROOT %s = f32[1024]{0} add(%m, %b)
}

%body (param: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %param = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[1024]{0} get-tuple-element(%param), index=1
  %ag-start = (f32[1024]{0}, f32[4096]{0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7},{8,9,10,11},{12,13,14,15}}, dimensions={0}
  %y = f32[1024]{0} fusion(%x, %x), kind=kLoop, calls=%multiply_add
  %ag-done = f32[4096]{0} all-gather-done(%ag-start)
  %next = s32[] add(%i, %i)
  ROOT %out = (s32[], f32[1024]{0}) tuple(%next, %y)
}

%cond (param.1: (s32[], f32[1024])) -> pred[] {
  %param.1 = (s32[], f32[1024]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: bf16[128,256], b: bf16[256,512], x: f32[1024], q: bf16[1,1024,4,64]) -> bf16[128,512] {
  %a.1 = bf16[128,256]{1,0} parameter(0)
  %b.1 = bf16[256,512]{1,0} parameter(1)
  %x.1 = f32[1024]{0} parameter(2)
  %q = bf16[1,1024,4,64]{3,2,1,0} parameter(3)
  %g = bf16[128,512]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%gemm_computation
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}) tuple(%zero, %x.1)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %cp-start = (bf16[128,512]{1,0}, bf16[128,512]{1,0}) collective-permute-start(%g), channel_id=2, source_target_pairs={{0,8},{8,0}}
  %cp-done = bf16[128,512]{1,0} collective-permute-done(%cp-start)
  %h-start = (bf16[128,512]{1,0}, bf16[128,512]{1,0:S(5)}, u32[]) copy-start(%cp-done)
  %fmha = (bf16[1,1024,4,64]{3,2,1,0}, f32[1,4,1024]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"intermediate_tensor_shape":{"dimensions":["1","4","1024","1024"]},"mask_type":"CAUSAL"}}
  %h-done = bf16[128,512]{1,0:S(5)} copy-done(%h-start)
  ROOT %result = bf16[128,512]{1,0} copy(%cp-done)
}
"""
TWO_NODES = [0] * 8 + [1] * 8


def hand_cost(efficiency=Efficiency()):
    return estimate(parse_module(MODULE), gpu=H100_GPU, efficiency=efficiency, node_of=TWO_NODES,
                    tokens_per_step=1024, model_flops_per_device=1e9)


@pytest.mark.fast
def test_parser_reads_loops_groups_and_host_arrays():
    module = parse_module(MODULE)
    loop = module.entry_computation.by_name["loop"]
    assert loop.known_trip_count == 3 and set(loop.called) == {"cond", "body"}
    gather = module.computations["body"].by_name["ag-start"]
    assert gather.device_groups(16) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert module.entry_computation.by_name["cp-start"].source_target_pairs() == [(0, 8), (8, 0)]
    assert [a.on_host for a in module.entry_computation.by_name["h-done"].arrays] == [True]


@pytest.mark.fast
def test_counts_of_a_hand_written_program_are_exact():
    cost = hand_cost()
    assert cost.flops_by_kind["matmul"] == 2 * 128 * 512 * 256
    # The body's multiply and add (2 x 1024 per trip), its scalar add, the condition's compare (4 evaluations).
    assert cost.flops_by_kind["other"] == 3 * (2 * 1024 + 1) + 4
    # Causal cuDNN forward: QK^T and PV, 4 x B x H x S x S x d, over the lower triangle with its diagonal.
    assert cost.flops_by_kind["attention"] == 4 * 1 * 4 * 1024 * 1024 * 64 * 1025 / 2048
    assert cost.collective_bytes_by_kind == {
        "all-gather nvlink": 3 * 3 * 1024 * 4,  # 3 trips, (n - 1) x the f32[1024] input, inside a node
        "collective-permute infiniband": 128 * 512 * 2,  # device 0 <-> 8: across the nodes
    }
    assert cost.host_bytes == 128 * 512 * 2
    # gemm + 3 x (all-gather, fusion, add) + 4 x compare + permute + host copy + cuDNN + copy
    assert cost.kernels == 1 + 3 * 3 + 4 + 1 + 1 + 1 + 1
    assert cost.unknown_trip_loops == 0


@pytest.mark.fast
def test_a_custom_call_of_unknown_kind_is_reported_never_priced_at_zero_in_silence():
    """A kernel the planner does not know (a Pallas one, say) inside the loop:
    counted at its memory traffic, three times, and named in the report."""
    pallas = ('  %k = f32[1024]{0} custom-call(%y), custom_call_target="my_pallas_kernel"\n'
              '  %ag-done = f32[4096]{0} all-gather-done(%ag-start)\n')
    module = MODULE.replace("  %ag-done = f32[4096]{0} all-gather-done(%ag-start)\n", pallas)
    cost = estimate(parse_module(module), gpu=H100_GPU, efficiency=Efficiency(), node_of=TWO_NODES,
                    tokens_per_step=1024, model_flops_per_device=1e9)
    assert cost.unpriced_custom_calls == {"my_pallas_kernel": {"calls": 3, "bytes": 3 * 2 * 1024 * 4}}
    assert cost.hbm_bytes == hand_cost().hbm_bytes + 3 * 2 * 1024 * 4
    assert cost.kernels == hand_cost().kernels + 3
    assert hand_cost().unpriced_custom_calls == {}  # cuDNN attention is priced
    report = format_cost(cost)
    assert "custom calls the planner cannot price, counted at their memory traffic only" in report
    assert "my_pallas_kernel x 3 (24.0 KiB)" in report


SLICE_UPDATE = """
HloModule slices, is_scheduled=true

%slice_update (buf: f32[64,1024], x: f32[1,1024], i: s32[]) -> f32[64,1024] {
  %buf = f32[64,1024]{1,0} parameter(0)
  %x = f32[1,1024]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = f32[1,1024]{1,0} dynamic-slice(%buf, %i, %z), dynamic_slice_sizes={1,1024}
  %new = f32[1,1024]{1,0} add(%old, %x)
  ROOT %dus = f32[64,1024]{1,0} dynamic-update-slice(%buf, %new, %i, %z)
}

ENTRY %main (buf.1: f32[64,1024], x.1: f32[1,1024], i.1: s32[]) -> f32[64,1024] {
  %buf.1 = f32[64,1024]{1,0} parameter(0)
  %x.1 = f32[1,1024]{1,0} parameter(1)
  %i.1 = s32[] parameter(2)
  CALL
}
"""
SYNC = "ROOT %f = f32[64,1024]{1,0} fusion(%buf.1, %x.1, %i.1), kind=kLoop, calls=%slice_update"
ASYNC = ("%f-start = ((f32[64,1024]{1,0}, f32[1,1024]{1,0}, s32[]), f32[64,1024]{1,0}, s32[]) "
         "fusion-start(%buf.1, %x.1, %i.1), kind=kLoop, calls=%slice_update\n"
         "  ROOT %f-done = f32[64,1024]{1,0} fusion-done(%f-start)")


@pytest.mark.fast
@pytest.mark.parametrize("call", [SYNC, ASYNC], ids=["fusion", "fusion-start"])
def test_a_buffer_sliced_and_updated_in_place_moves_only_its_slices(call):
    """One row of a [64, 1024] buffer read, added to and written back in place (a tile's accumulator):
    the row read, x read, the index, the row written; the same when XLA:GPU runs the fusion
    asynchronously (jax 0.11 does so with slicing fusions), not the whole buffer and its tuple."""
    cost = estimate(parse_module(SLICE_UPDATE.replace("CALL", call)), gpu=H100_GPU, efficiency=Efficiency(),
                    node_of=[0], tokens_per_step=1, model_flops_per_device=1.0)
    row = 1024 * 4
    assert cost.hbm_bytes == row + row + 4 + row


@pytest.mark.fast
def test_time_is_the_roofline_of_each_kernel_in_schedule_order():
    eff = Efficiency(launch_us=0.0)
    cost = hand_cost(eff)
    hbm = H100_GPU.hbm_bytes_per_s * eff.hbm
    gemm_bytes = (128 * 256 + 256 * 512 + 128 * 512) * 2
    gemm = max(2 * 128 * 512 * 256 / (H100_GPU.peak_bf16_flops * eff.gemm), gemm_bytes / hbm)
    fusion = max(2048 / H100_GPU.peak_bf16_flops, 3 * 4096 / hbm)  # reads x twice, writes y
    scalar = max(1 / H100_GPU.peak_bf16_flops, 12 / hbm)  # s32 add: two reads, one write
    compare = max(1 / H100_GPU.peak_bf16_flops, 9 / hbm)  # s32 and constant in, pred out
    gather = 3 * 4096 / (H100_GPU.nvlink_bytes_per_s * eff.links)
    body = max(gather, fusion) + scalar  # the all-gather runs beside the fusion; the add waits for neither
    permute = 128 * 512 * 2 / (H100_GPU.infiniband_bytes_per_s * eff.links)
    host = 128 * 512 * 2 / (H100_GPU.pcie_bytes_per_s * eff.links)
    flops = 4 * 4 * 1024 * 1024 * 64 * 1025 / 2048
    fmha = max(flops / (H100_GPU.peak_bf16_flops * eff.attention_fwd), (4 * 1024 * 4 * 64 * 2 + 4 * 1024 * 4) / hbm)
    copy = 2 * 128 * 512 * 2 / hbm
    # The permute is waited for at once; the host copy runs beside the cuDNN call, the final copy after both.
    expected = gemm + 3 * body + 4 * compare + permute + max(host, fmha) + copy
    assert cost.step_time_s == pytest.approx(expected, rel=1e-12)


@pytest.mark.fast
def test_each_launch_costs_its_overhead():
    with_launches, without = hand_cost(Efficiency(launch_us=5.0)), hand_cost(Efficiency(launch_us=0.0))
    # Every launch adds 5 us to the timeline, except those of async starts whose work outlasts them.
    assert with_launches.step_time_s - without.step_time_s == pytest.approx(with_launches.kernels * 5e-6, rel=0.05)


@pytest.mark.fast
def test_efficiency_overrides_are_checked():
    assert Efficiency().with_overrides(["attention_fwd=0.55", "launch_us=0"]).attention_fwd == 0.55
    for bad, message in (["gemm=1.5"], "in (0, 1]"), (["speed=1"], "KEY one of"), (["hbm=x"], "a number"):
        with pytest.raises(Exception, match=message.replace("(", r"\(").replace("]", r"\]")):
            Efficiency().with_overrides(bad)


@pytest.mark.fast
def test_cost_keys_are_the_json_contract():
    assert set(hand_cost().as_dict()) == {*COST_KEYS, "cost_note"}
    assert set(cost_dict(None)) == {*COST_KEYS, "cost_note"}


@pytest.mark.fast
def test_bad_efficiency_is_a_one_line_error():
    result = run_cli("plan", "configs/tiny.yaml", "--target", "cpu", "--efficiency", "gemm=2")
    # checked before anything compiles
    assert_one_line_error(result, "--efficiency gemm must be in (0, 1]")


@pytest.mark.fast
@needs_gpu_compiler
def test_a_compiled_matmul_and_all_gather_are_counted_exactly():
    """x [128, 256] @ w [256, 512] per device, then an all-gather of the
    [128, 512] results over 8 H100s: XLA:GPU splits the gemm along K and adds
    a reduction fusion; three launches in all."""
    devices = gpu_devices("h100", 8)
    mesh = jax.sharding.Mesh(devices, ("x",))

    def per_device(x, w):
        return jax.lax.all_gather(x @ w, "x", axis=0, tiled=True)

    program = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P()), out_specs=P(), check_vma=False))
    x = jax.ShapeDtypeStruct((8 * 128, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    hlo = program.lower(x, w).compile().as_text()
    cost = estimate(parse_module(hlo), gpu=H100_GPU, efficiency=Efficiency(), node_of=[0] * 8, tokens_per_step=1,
                    model_flops_per_device=1)
    assert cost.flops_by_kind["matmul"] == 2 * 128 * 512 * 256
    assert cost.collective_bytes_by_kind == {"all-gather nvlink": 7 * 128 * 512 * 2}
    assert cost.kernels == 3


@needs_gpu_compiler
def test_offload_attention_moves_attention_outputs_to_host_and_skips_the_recomputed_kernel():
    inputs, attention = (compiled_step(whole_stack(f"memory.remat={r}"))
                         for r in ("offload_inputs", "offload_attention"))
    config = whole_stack("memory.remat=offload_attention")
    # What XLA:GPU places in host memory: the layer inputs, the attention outputs and log-sum-exps.
    assert plan_of(attention).host_offload == saved_layer_input_bytes(config) + offloaded_attention_bytes(config)
    assert offloaded_attention_bytes(config) == 2 * 1 * 1024 * 8 * (64 * 2 + 4)  # layers x seqs x tokens x heads
    with_recompute, without = step_cost(inputs), step_cost(attention)
    # Forward (4 units) twice and backward (10) vs forward once and backward.
    ratio = without.flops_by_kind["attention"] / with_recompute.flops_by_kind["attention"]
    assert ratio == pytest.approx((4 + 10) / (4 + 4 + 10), rel=1e-12)
    assert without.step_time_s < with_recompute.step_time_s
    assert without.recompute_factor < with_recompute.recompute_factor
    report = cost_dict(without)  # what `jlong plan --json` carries
    assert report["step_time_s"] > 0 and report["executed_flops"] > report["model_flops"] > 0
    assert report["kernels"] > 0 and report["collective_bytes"] > 0 and report["host_bytes"] > 0


@needs_gpu_compiler
def test_plan_prints_the_step_cost(tmp_path):
    config = tmp_path / "stack.yaml"
    config.write_text("{}\n")
    text = run_cli("plan", config, *WHOLE_STACK, "--target", "h100")
    assert text.returncode == 0, text.stderr
    assert "not a measurement" in text.stdout and "tokens/s" in text.stdout and "kernel launches" in text.stdout


@pytest.mark.slow  # a search over many compiled plans; CI prices single plans in the tests above
@needs_gpu_compiler
def test_fastest_ranks_the_fitting_settings_by_estimated_tokens_per_s():
    result = run_cli("maxlen", "configs/tiny.yaml", "data.source=synthetic", "--target", "h100", "--fastest",
                     "--search", "memory.remat=offload_inputs,offload_attention", "memory.layers_per_checkpoint=1,2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    speeds = {line.split(":")[0].strip(): int(re.search(r"([\d,]+) tokens/s", line).group(1).replace(",", ""))
              for line in lines if "tokens/s, executed" in line}
    assert len(speeds) == 3  # offload_attention with 2 layers per checkpoint is refused, and says why
    assert any("refused (memory.layers_per_checkpoint=2" in line for line in lines)
    fastest = max(speeds, key=speeds.get)
    assert lines[-1].startswith(f"fastest setting that fits: {fastest} ")


@needs_gpu_compiler
def test_the_search_compares_sequence_parallel_methods():
    result = run_cli("maxlen", "configs/tiny.yaml", "data.source=synthetic", "--target", "h100", "--fastest",
                     "--search", "attention.sp_method=ulysses,allgather")
    assert result.returncode == 0, result.stderr
    ranked = [line for line in result.stdout.splitlines() if "tokens/s, executed" in line]
    assert len(ranked) == 2 and any("allgather" in line for line in ranked), result.stdout


@pytest.mark.fast
def test_fastest_needs_a_gpu_target():
    result = run_cli("maxlen", "configs/tiny.yaml", "--target", "cpu", "--fastest", "--search", "memory.mlp_tile=0,64")
    assert_one_line_error(result, "--fastest ranks settings by the step cost")


def test_cpu_target_has_no_step_cost_and_says_why():
    result = run_cli("plan", "configs/tiny.yaml", "--target", "cpu", "--json", "data.source=synthetic")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["step_time_s"] is None and "XLA:GPU program" in report["cost_note"]


@pytest.mark.fast
@pytest.mark.parametrize("conditional", [
    '  %p = pred[] constant(true)\n'
    '  %c = bf16[128,512]{1,0} conditional(%p, %g, %g), true_computation=%copy_branch, '
    'false_computation=%gemm_branch\n',
    # an index and a list of branches, as jax's lax.cond and lax.switch lower
    '  %p = s32[] constant(0)\n'
    '  %c = bf16[128,512]{1,0} conditional(%p, %g, %g), branch_computations={%copy_branch, %gemm_branch}\n',
], ids=["true-false", "branch-list"])
def test_a_conditional_costs_its_costliest_branch(conditional):
    module = MODULE.replace(
        '  ROOT %result = bf16[128,512]{1,0} copy(%cp-done)',
        conditional + '  ROOT %result = bf16[128,512]{1,0} copy(%c)',
    ) + """
%copy_branch (t: bf16[128,512]) -> bf16[128,512] {
  %t = bf16[128,512]{1,0} parameter(0)
  ROOT %tc = bf16[128,512]{1,0} copy(%t)
}

%gemm_branch (f: bf16[128,512]) -> bf16[128,512] {
  %f = bf16[128,512]{1,0} parameter(0)
  %sq = bf16[128,512]{1,0} multiply(%f, %f)
  ROOT %fc = bf16[128,512]{1,0} add(%sq, %f)
}
"""
    base = hand_cost()
    branched = estimate(parse_module(module), gpu=H100_GPU, efficiency=Efficiency(), node_of=TWO_NODES,
                        tokens_per_step=1024, model_flops_per_device=1e9)
    assert branched.kernels == base.kernels + 2  # the costlier branch's two kernels, not the copy
    assert branched.flops_by_kind["other"] == base.flops_by_kind["other"] + 2 * 128 * 512
