"""Mixtures of experts: the grouped matmul kernel against ragged_dot, the
load-balancing loss and the expert load against transformers' router
logits, every sequence-parallel layout against one device (logits against
transformers: test_hf_parity), and the compiled h100 program: FLOPs for the
routed tokens, temporaries that do not grow with the experts."""

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import (H100, REPO, assert_same_result, leaf_at, loss_and_grads, needs_gpu_compiler, small_config,
                     tensorboard_scalars)
from hf_models import small_hf_model

import jlong
from jlong.errors import JlongError
from jlong.config import load_config
from jlong.families import family_of
from jlong.config import config_to_dict
from jlong.config.identity import changes
from jlong.model.transformer import ForwardOptions
from jlong.ops.shards import OneDevice
from jlong.training import routing_watch
from jlong.moe import grouped_matmul, grouped_matmul_triton, routing, row_tiles
from jlong.planner.memory import compile_train_step, plan_of
from jlong.planner.pricing import Efficiency
from jlong.planner.step_cost import step_cost
from jlong.training.loop import train
from jlong.training.metric_sinks import TENSORBOARD_DIR

QWEN3_MOE = ["model.preset=tiny-qwen3-moe", "model.vocab_size=128", "model.hidden_size=64",
             "model.intermediate_size=96", "model.moe_intermediate_size=32", "model.num_hidden_layers=3",
             "model.mlp_only_layers=[1]", "model.router_aux_loss_coef=0.1",
             "data.eos_id=7", "train.batch_size=2", "train.seq_len=256"]
QWEN3_5_MOE = ["model.preset=tiny-qwen3.5-moe", "model.vocab_size=128", "model.hidden_size=64",
               "model.intermediate_size=48", "model.moe_intermediate_size=32", "model.num_key_value_heads=2",
               "model.num_hidden_layers=2", "model.full_attention_interval=2", "model.router_aux_loss_coef=0.1",
               "data.eos_id=7", "train.batch_size=2", "train.seq_len=256"]


# Groups of every kind: empty ones, one of a single row, ones spanning two tiles (of 64 rows and of 128),
# several in one tile; 200 rows, not a whole number of tiles.
GROUP_SIZES = [30, 0, 70, 1, 0, 64, 35, 0]


@pytest.mark.fast
def test_the_triton_grouped_matmul_equals_ragged_dot_with_its_gradients():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((200, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.float32)
    sizes = jnp.asarray(GROUP_SIZES, jnp.int32)

    def loss(kernel, x, w):
        return jnp.sum(jnp.sin(kernel(x, w, sizes)))

    triton = functools.partial(grouped_matmul_triton.grouped_matmul, interpret=True)
    want = jax.value_and_grad(functools.partial(loss, jax.lax.ragged_dot), argnums=(0, 1))(x, w)
    got = jax.value_and_grad(functools.partial(loss, triton), argnums=(0, 1))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-4)


@pytest.mark.fast
def test_a_triton_width_not_a_multiple_of_16_is_one_line():
    sizes = jnp.asarray([3, 5], jnp.int32)
    with pytest.raises(JlongError, match="the Triton grouped matmul needs matrix widths that are multiples of 16, got 24"):
        grouped_matmul_triton.grouped_matmul(jnp.ones((8, 24)), jnp.ones((2, 24, 32)), sizes, interpret=True)


@needs_gpu_compiler
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "float32"])
def test_the_triton_kernels_fit_an_h100s_shared_memory_at_qwen3_moes_expert_shapes(dtype):
    """XLA:GPU, deviceless (Triton checks each kernel's shared memory against the SM's): the product,
    its input gradient and the weight gradient at Qwen3-30B-A3B's 2048 -> 768 and 768 -> 2048, in bf16
    (training) and float32. The small shapes of the other tests never reach the largest tiles."""
    sharding = jax.sharding.SingleDeviceSharding(H100.devices(1)[0])
    spec = lambda *shape, dt=dtype: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731

    def loss(x, up, down, sizes):
        h = grouped_matmul_triton.grouped_matmul(x, up, sizes)
        return jnp.sum(grouped_matmul_triton.grouped_matmul(h, down, sizes).astype(jnp.float32))

    args = (spec(1024, 2048), spec(8, 2048, 768), spec(8, 768, 2048), spec(8, dt=jnp.int32))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    assert f'"{grouped_matmul_triton.PRODUCT}"' in hlo and f'"{grouped_matmul_triton.WEIGHT_GRADIENT}"' in hlo


@pytest.mark.fast
@pytest.mark.parametrize("seed", range(3))
def test_work_items_cover_every_row_once_within_their_bound(seed):
    """Each real (group, tile) item's rows are that tile's rows of that group;
    together they are every row once, in at most rows / 64 + G - 1 items."""
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(1000, rng.dirichlet(np.full(16, 0.3)))
    rows = 1024
    starts, ends = row_tiles.group_bounds(jnp.asarray(sizes, jnp.int32))
    group, tile, real = map(np.asarray, row_tiles.work_items(starts, ends, rows, 64))
    assert len(group) == rows // 64 + 16 - 1 and real <= len(group)
    ends = np.cumsum(sizes)
    covered = np.zeros(rows, int)
    for g, t in zip(group[:real], tile[:real]):
        in_tile = np.arange(t * 64, (t + 1) * 64)
        mine = in_tile[(in_tile >= ends[g] - sizes[g]) & (in_tile < ends[g])]
        assert len(mine), (g, t)
        covered[mine] += 1
    assert (covered[:1000] == 1).all() and (covered[1000:] == 0).all()


def test_a_model_on_the_triton_kernel_gives_the_ragged_dot_logits(tmp_path, monkeypatch):
    """The kernel as the model runs it on a GPU (here interpreted): the tiny Qwen3.5-MoE's logits."""
    monkeypatch.setitem(grouped_matmul.KERNELS, "triton",
                        functools.partial(grouped_matmul_triton.grouped_matmul, interpret=True))
    hf_model = small_hf_model("qwen3.5-moe", moe_intermediate_size=32)  # Triton's dots: multiples of 16
    hf_model.save_pretrained(tmp_path)
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 96, (1, 40)))
    reference = jlong.from_hf(tmp_path)(tokens)
    on_triton = jlong.from_hf(tmp_path, options=ForwardOptions(grouped_matmul="triton"))(tokens)
    np.testing.assert_allclose(np.asarray(on_triton), np.asarray(reference), rtol=0, atol=1e-4)


def _routing_reference(hf_model, tokens, top_k):
    """transformers' training loss with output_router_logits, its auxiliary loss taken per layer
    (`jlong.moe.routing`: transformers' own load_balancing_loss_func of each MoE layer's router logits alone,
    averaged over the layers, in place of its one over every layer's pooled), and the worst layer's busiest
    expert over the mean, counted from its router logits."""
    with torch.no_grad():
        out = hf_model(torch.as_tensor(tokens), labels=torch.as_tensor(tokens), output_router_logits=True)
    balance = sys.modules[type(hf_model).__module__].load_balancing_loss_func
    num_experts = out.router_logits[0].shape[-1]
    per_layer = float(np.mean([float(balance((logits,), num_experts, top_k)) for logits in out.router_logits]))
    coef = hf_model.config.router_aux_loss_coef
    worst = 0.0
    for logits in out.router_logits:
        chosen = torch.topk(logits.softmax(-1), top_k, dim=-1).indices.reshape(-1).numpy()
        pairs = np.bincount(chosen, minlength=logits.shape[-1])
        worst = max(worst, pairs.max() / pairs.mean())
    return float(out.loss) + coef * (per_layer - float(out.aux_loss)), per_layer, worst


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-moe-unnormed", "qwen3.5-moe", "gpt-oss"])
def test_load_balancing_loss_and_expert_load_match_transformers(name, tmp_path):
    """Each model has two or more MoE layers, so the loss per layer is not transformers' pooled one."""
    hf_model = small_hf_model(name, output_router_logits=True, router_aux_loss_coef=0.25)
    hf_model.save_pretrained(tmp_path)
    tokens = np.random.default_rng(3).integers(0, 96, (2, 70))
    loss, aux_loss, worst = _routing_reference(hf_model, tokens, hf_model.config.num_experts_per_tok)
    model = jlong.from_hf(tmp_path, options=ForwardOptions(router_aux_loss=True))
    assert model.config.output_router_logits and model.config.router_aux_loss_coef == 0.25
    # transformers predicts each token but the last from the ones before; all 70 are routed.
    mask = np.ones(tokens.shape, np.float32)
    mask[:, -1] = 0
    batch = {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, axis=1)),
             "loss_mask": jnp.asarray(mask)}
    got, metrics = jax.jit(lambda m, b: m.loss_and_metrics(b))(model, batch)
    np.testing.assert_allclose(float(metrics["router_aux_loss"]), aux_loss, rtol=1e-5)
    np.testing.assert_allclose(float(got), loss, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["expert_load_max_over_mean"]), worst, rtol=1e-6)
    assert aux_loss > model.config.num_experts_per_tok  # the random router is unbalanced: the loss has work


@pytest.mark.fast
def test_the_load_balancing_loss_sees_each_layer_where_pooled_layers_would_cancel():
    """Two layers of 4 experts, one per token, each sending every token to its own favourite (probability 0.7):
    per layer the loss is 4 x 0.7 = 2.8, where 1 is balanced; pooled over both layers (transformers' form), the
    shares and probabilities spread over two experts and it reads 1.6."""
    probabilities = np.full((2, 4), 0.1, np.float32)
    probabilities[0, 0] = probabilities[1, 1] = 0.7
    tokens = np.zeros((2, 4), np.float32)
    tokens[0, 0] = tokens[1, 1] = 100.0
    statistics = {routing.EXPERT_TOKENS: jnp.asarray(tokens),
                  routing.EXPERT_PROBABILITIES: jnp.asarray(100 * probabilities),
                  routing.ROUTED_TOKENS: jnp.asarray([100.0, 100.0])}
    assert float(routing.load_balancing_loss(statistics)) == pytest.approx(2.8)
    pooled_f, pooled_p = tokens.sum(0) / 200, probabilities.sum(0) / 2
    assert 4 * float(np.sum(pooled_f * pooled_p)) == pytest.approx(1.6)
    assert float(routing.expert_load_max_over_mean(statistics)) == pytest.approx(4.0)  # one expert takes all


def _sharp_routers(params):
    """The routers scaled up, so that no token's top-k is a near tie that rounding could flip."""
    params["layers"]["router"] = params["layers"]["router"] * 50.0
    return params


def _loss_and_grads(config, devices):
    return loss_and_grads(config, devices, adjust=_sharp_routers)


def _one_device(model: str):
    return _loss_and_grads(small_config(*MODELS[model]), jax.devices()[:1])


# Qwen3.5-MoE on a mesh: test_chat's packed conversations on sp 4 x fsdp 2 (its Gated DeltaNet on a ring:
# test_qwen3_5).
MODELS = {"qwen3-moe": QWEN3_MOE}
TILED = ["memory.mlp_tile=32"]
SP = ["mesh.sp=4", "mesh.fsdp=2"]


@pytest.mark.parametrize("model, layout", [
    ("qwen3-moe", SP + TILED), ("qwen3-moe", SP + ["kernels.grouped_matmul=triton"]),
], ids=["qwen3-moe-sp4-fsdp2-tiled", "qwen3-moe-sp4-fsdp2-triton"])
def test_training_on_a_mesh_equals_one_device(model, layout):
    """Loss (with the load-balancing loss) and gradients of packed documents,
    the experts in sequence tiles of 32 tokens (a device's whole shard as one
    tile: the metrics test below, and every one-device test)."""
    sharded = _loss_and_grads(small_config(*MODELS[model], *layout), jax.devices())
    assert_same_result(sharded, _one_device(model))
    grads = sharded[1]["layers"]
    assert np.abs(grads["router"]).max() > 0 and np.abs(grads["expert_down"]).max() > 0


def test_training_on_the_mosaic_kernels_equals_ragged_dot():
    """The Mosaic GPU grouped matmul (interpreted, one device: jax 0.10's interpreter runs no kernel inside
    shard_map over several) trains as ragged_dot does (one sequence, one expert layer), loss and gradients in
    bf16 (the kernels take 16-bit operands): within 5% of each gradient's largest entry, where bf16 sums
    taken in another order differ by up to 3% and rows multiplied by a wrong expert by their whole size. Its
    h100 program on sp 8: test_grouped_matmul_mosaic."""
    bf16 = [*QWEN3_MOE, "model.moe_intermediate_size=64", "train.compute_dtype=bfloat16", "train.batch_size=1",
            "model.num_hidden_layers=2"]
    one = jax.devices()[:1]
    (loss, grads), (want_loss, want_grads) = (
        _loss_and_grads(small_config(*bf16, "kernels.grouped_matmul=mosaic"), one),
        _loss_and_grads(small_config(*bf16, "kernels.grouped_matmul=ragged_dot"), one))
    np.testing.assert_allclose(loss, want_loss, rtol=1e-3)
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        want = leaf_at(want_grads, path)
        np.testing.assert_allclose(leaf, want, rtol=0, atol=5e-2 * np.abs(want).max(), err_msg=jax.tree_util.keystr(path))
    assert np.abs(grads["layers"]["expert_down"]).max() > 0
    with pytest.raises(JlongError, match="not inside shard_map over 8"):
        _loss_and_grads(small_config(*bf16, "kernels.grouped_matmul=mosaic", "train.batch_size=2", *SP), jax.devices())


@pytest.mark.fast
def test_flops_count_the_routed_experts_only():
    """Model FLOPs count k of E experts per token: with more experts of the same
    size, k fixed, a token's FLOPs do not change; the router's do."""
    config = small_config(*QWEN3_MOE).model
    family = family_of(config)
    wider = config.model_copy(update={"num_experts": 4 * config.num_experts})
    router = config.hidden_size * config.num_experts * 3  # three times the router per sparse layer...
    extra = 2 * router  # ...in the two sparse layers, x6 FLOPs per parameter
    assert family.flops_per_token(wider, 256) - family.flops_per_token(config, 256) == pytest.approx(6 * extra)


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["model.num_experts_per_tok=9"], "more than model.num_experts"),
    (["model.num_experts=null"], "set model.num_experts"),
    (["model.layer_types=[moe,sliding_attention,moe]"], "not a Qwen3-MoE layer type"),
])
def test_expert_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(JlongError, match=message):
        small_config(*QWEN3_MOE, *overrides)


@pytest.mark.fast
def test_qwen3_5_moe_always_renormalises():
    with pytest.raises(JlongError, match="always renormalises"):
        small_config(*QWEN3_5_MOE, "model.norm_topk_prob=false")


@pytest.mark.fast
def test_the_load_balancing_loss_is_trained_by_default_and_may_be_turned_off():
    on, off = small_config(*QWEN3_MOE), small_config(*QWEN3_MOE, "train.router_aux_loss=false")
    assert not on.model.output_router_logits  # the train-level setting alone decides
    assert ForwardOptions.for_training(on, OneDevice(), "cpu").router_aux_loss
    assert not ForwardOptions.for_training(off, OneDevice(), "cpu").router_aux_loss
    record = config_to_dict(on)
    del record["train"]["router_aux_loss"]  # a run written before the setting existed
    assert not changes(record, config_to_dict(on)).refused
    assert changes(config_to_dict(off), config_to_dict(on)).refused == ["train.router_aux_loss"]


@pytest.mark.fast
def test_routing_that_stays_collapsed_is_said_once():
    watch = routing_watch.RoutingWatch(8, 2, 0.001, aux_loss_trained=True)  # the most: 8 / 2 = 4
    loads = [4.0, 4.0, 1.2, *[3.9] * routing_watch.STEPS, 4.0, 4.0]
    said = [(step, line) for step, load in enumerate(loads, 1)
            if (line := watch.observe(step, {"expert_load_max_over_mean": load}))]
    assert [step for step, _ in said] == [3 + routing_watch.STEPS]
    assert "raise model.router_aux_loss_coef (now 0.001)" in said[0][1] and "\n" not in said[0][1]
    untrained = routing_watch.RoutingWatch(8, 2, 0.001, aux_loss_trained=False)
    lines = [untrained.observe(step, {"expert_load_max_over_mean": 4.0}) for step in range(1, 7)]
    assert "train.router_aux_loss=true" in lines[routing_watch.STEPS - 1]
    assert untrained.observe(1, {}) is None


@functools.cache
def _compiled_moe(*overrides):
    """Two layers of configs/qwen3-30b-a3b-1m.yaml at 32,768 tokens (4,096 per device: experts dominate),
    compiled for 8 H100s; once per test process (the two tests below share its 128 experts)."""
    config = load_config(REPO / "configs" / "qwen3-30b-a3b-1m.yaml", [
        "train.seq_len=32768", "model.num_hidden_layers=2", "memory.remat=offload_inputs", "memory.remat_runs={}",
        *overrides])
    return config, compile_train_step(config, H100)


@needs_gpu_compiler
def test_on_h100_the_experts_cost_their_routed_flops_in_static_loops():
    _, step = _compiled_moe()
    cost = step_cost(step)
    assert step.text.count('custom_call_target="__gpu$xla.gpu.triton"') >= 3  # forward, dx, dw
    assert not cost.unpriced_custom_calls and not cost.unknown_trip_loops
    assert cost.model_flops <= cost.executed_flops <= 1.6 * cost.model_flops
    # priced at the Triton kernels' own measured share of the peak, apart from cuBLAS's matmuls
    twice_as_fast = step_cost(step, Efficiency(grouped_matmul=2 * Efficiency().grouped_matmul))
    grouped = cost.time_by_kind["grouped matmul"]
    assert twice_as_fast.time_by_kind["grouped matmul"] == pytest.approx(grouped / 2, rel=0.02)
    assert twice_as_fast.time_by_kind["matmul"] == cost.time_by_kind["matmul"]


@needs_gpu_compiler
def test_on_h100_temporaries_grow_with_the_experts_by_their_weights_only():
    """Twice the experts add at most a layer's new experts in bf16 and their float32 gradients: no
    [tokens, experts, ...] buffer (which would add 32,768 routed rows x 64 experts x 768 x 2 bytes,
    3 GiB, per product)."""
    config, step = _compiled_moe("model.num_experts=64")
    _, doubled = _compiled_moe()  # the config's own 128
    model = config.model
    new_experts = 64 * 3 * model.hidden_size * model.moe_intermediate_size  # parameters of one layer
    growth = plan_of(doubled).temporaries - plan_of(step).temporaries
    assert 0 < growth <= new_experts * (2 + 4)


def test_each_steps_expert_load_and_auxiliary_loss_reach_metrics_and_tensorboard(tmp_path, monkeypatch, capsys):
    """A short run of the tiny Qwen3-MoE on sp 4 x fsdp 2, the load-balancing loss trained without a setting;
    routing that stays near its most unbalanced is said once (here the watch's bar is lowered to any load)."""
    monkeypatch.setattr(routing_watch, "NEAR_CEILING", 0.0)
    monkeypatch.setattr(routing_watch, "STEPS", 2)
    config = small_config(*QWEN3_MOE, "train.steps=3", "train.seq_len=64", "mesh.sp=4", "mesh.fsdp=2",
                          "train.log_to=[jsonl,tensorboard]", f"run_dir={tmp_path / 'run'}", "checkpoint.every=0")
    train(config)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["expert_load_max_over_mean"] >= 1.0 and record["router_aux_loss"] > 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if "routing has collapsed" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: routing has collapsed: at steps 1-2")
    events = {(tag, step): value for tag, step, value in tensorboard_scalars(tmp_path / "run" / TENSORBOARD_DIR)}
    for record in records:
        for name in ("expert_load_max_over_mean", "router_aux_loss"):
            assert events[(f"train/{name}", record["step"])] == pytest.approx(record[name], rel=1e-6)
