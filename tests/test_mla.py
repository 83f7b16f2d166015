"""Multi-head latent attention and DeepSeek's mixtures (`jlong.families.deepseek`: deepseek_v2, deepseek_v3,
glm4_moe_lite): the kernels take values of their own head size (local, ring, sliding ring; blockwise and cuDNN's
code), `jlong convert` writes back what transformers reads to the same logits (logits against transformers:
test_hf_parity's tiny models), training on every sequence-parallel layout equals one device, greedy decoding
is transformers' argmax, bad checkpoints are one line, and the presets hold their published sizes."""

import functools
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from cudnn_emulation import emulate_cudnn
from helpers import Batches, assert_one_line_error, assert_same_result, loss_and_grads, run_cli, small_config
from hf_models import hf_logits, small_hf_model
from jax.sharding import AxisType, PartitionSpec

import jlong
from jlong.attention.cudnn import CudnnStep
from jlong.attention.kernels import AttentionKernel, choose_kernel, reference_attention
from jlong.attention.ring import ring_attention
from jlong.config import load_config
from jlong.errors import JlongError
from jlong.families import family_of
from jlong.hf import model_config_from_hf
from jlong.ops.zigzag import chunk_token_index
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram

# DeepSeek-V3-shaped and small: compressed queries, values narrower than the queries and keys (24 = 16 + 8), YaRN
# with its softmax-scale correction, a dense first layer, then 8 routed experts in 4 groups (2 per token from the
# best 2 groups) and a shared expert; test_hf_parity's tiny models check the same maths against transformers.
DEEPSEEK_V3 = ["model.family=deepseek_v3", "model.num_attention_heads=8", "model.num_key_value_heads=8",
               "model.head_dim=24", "model.q_lora_rank=32", "model.kv_lora_rank=32", "model.qk_nope_head_dim=16",
               "model.qk_rope_head_dim=8", "model.v_head_dim=16", "model.num_experts=8", "model.num_experts_per_tok=2",
               "model.moe_intermediate_size=16", "model.n_shared_experts=1", "model.n_group=4", "model.topk_group=2",
               "model.norm_topk_prob=true", "model.routed_scaling_factor=2.5", "model.first_k_dense_replace=1",
               "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 16, "
               "mscale: 1.0, mscale_all_dim: 0.707}"]
TINY = [*DEEPSEEK_V3, "model.hidden_size=64", "model.intermediate_size=96", "data.eos_id=7", "train.batch_size=2",
        "train.seq_len=64", "train.compute_dtype=float32", "attention.block_size=8", "data.source=synthetic"]


# -- kernels: values of a head size of their own (DeepSeek's 192 / 128 in small: 24 / 16; GLM's wider values too)


def _qkv(seed, dq=24, dv=16, B=2, S=64, H=4, K=2):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (B, S, H, dq))
    k = jax.random.normal(keys[1], (B, S, K, dq))
    v = jax.random.normal(keys[2], (B, S, K, dv))
    starts = np.random.default_rng(seed).random((B, S)) < 0.1
    starts[1, 8:40] = False  # a document over several ring chunks
    return q, k, v, jax.random.normal(keys[3], (B, S, H, dv)), jnp.asarray(np.cumsum(starts, axis=1), jnp.int32)


def _on_ring(R, attend, q, k, v, segments):
    """attend(q, k, v, segments) per device on a ring of R devices in the zigzag layout, with its vjp, in order."""
    order = np.concatenate([np.asarray(chunk_token_index(rank, R, q.shape[1])) for rank in range(R)])
    mesh = jax.make_mesh((R,), ("ring",), axis_types=(AxisType.Auto,), devices=jax.devices()[:R])
    spec = PartitionSpec(None, "ring")
    run = jax.shard_map(attend, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
    out, pullback = jax.vjp(jax.jit(lambda q, k, v: run(q, k, v, segments[:, order])), q[:, order], k[:, order],
                            v[:, order])
    restore = np.argsort(order)
    return lambda do: [np.asarray(x)[:, restore] for x in (out, *pullback(do[:, order]))]


def _assert_attention_equal(got, q, k, v, do, segments, window=0):
    out, pullback = jax.vjp(lambda q, k, v: reference_attention(q, k, v, segments, window=window), q, k, v)
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, [out, *pullback(do)]):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=name)


@pytest.mark.fast
@pytest.mark.parametrize("dv", [16, 32])
def test_local_attention_takes_values_of_their_own_head_size(dv):
    """Packed documents, causal, one device, the blockwise kernel: values narrower (DeepSeek) and wider (GLM's
    tiny model) than the keys."""
    q, k, v, do, segments = _qkv(0, dv=dv)
    kernel = AttentionKernel("blockwise", block_size=16)
    out, pullback = jax.vjp(lambda q, k, v: kernel.local(q, k, v, segments), q, k, v)
    _assert_attention_equal([out, *pullback(do)], q, k, v, do, segments)


def _gathered(kernel):
    """The all-gather method's attention: every rank's keys and values gathered, the queries kept."""
    def attend(q, k, v, segments):
        gather = functools.partial(jax.lax.all_gather, axis_name="ring", axis=1, tiled=True)
        return kernel.gathered(q, gather(k), gather(v), segments, gather(segments), axis="ring", size=4)
    return attend


@pytest.mark.parametrize("impl, window, path", [
    ("blockwise", 0, "ring"), ("cudnn", 0, "ring"), ("blockwise", 8, "ring"), ("blockwise", 0, "gathered")],
                         ids=["blockwise", "cudnn", "sliding", "gathered"])
def test_ring_attention_takes_values_of_their_own_head_size(impl, window, path, monkeypatch):
    """4 ranks over packed documents: the ring (its local steps too), with the blockwise kernel and cuDNN's
    code (its calls emulated: the heads padded to one size); with a window of 8, the sliding path's halos; the
    all-gather method's keys and values gathered at hand."""
    if impl == "cudnn":
        emulate_cudnn(monkeypatch)
    q, k, v, do, segments = _qkv(1)
    kernel = AttentionKernel(impl, block_size=8, max_documents=16, window=window)
    attend = _gathered(kernel) if path == "gathered" else \
        (lambda q, k, v, s: kernel.ring(q, k, v, s, axis="ring", size=4))
    _assert_attention_equal(_on_ring(4, attend, q, k, v, segments)(do), q, k, v, do, segments, window)


@pytest.mark.fast
def test_a_ring_moving_the_latent_equals_attention_over_the_up_projected_heads():
    """4 ranks over packed documents: the ring passes (c, the rotary key) around and up-projects each chunk to
    the heads' keys and values; output and the gradients of q, c, the rotary key and W_kv_b are the reference's
    over the keys and values up-projected once."""
    from jlong.attention.latent import LatentProjection

    B, S, H, dn, dr, dv, rank = 2, 64, 4, 16, 8, 16, 16
    projection = LatentProjection(norm_eps=1e-6, rope_inv_freq=(1.0,) * (dr // 2), qk_nope_head_dim=dn,
                                  kv_lora_rank=rank)
    keys = jax.random.split(jax.random.PRNGKey(2), 5)
    q = jax.random.normal(keys[0], (B, S, H, dn + dr))
    latent = jax.random.normal(keys[1], (B, S, rank)), jax.random.normal(keys[2], (B, S, dr))
    w = jax.random.normal(keys[3], (rank, H, dn + dv)) / rank**0.5
    do = jax.random.normal(keys[4], (B, S, H, dv))
    _, _, _, _, segments = _qkv(1)
    kernel = AttentionKernel("blockwise", block_size=8)

    def reference(q, latent, w):
        weights, expand = projection.up_projection({"wkv_b": w}, (0, H))
        return reference_attention(q, *expand(weights, latent), segments)

    order = np.concatenate([np.asarray(chunk_token_index(rank, 4, S)) for rank in range(4)])
    mesh = jax.make_mesh((4,), ("ring",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    tokens = PartitionSpec(None, "ring")

    def per_device(q, latent, w, segments):
        weights, expand = projection.up_projection({"wkv_b": w}, (0, H))
        return kernel.latent_ring(q, latent, weights, expand, segments, axis="ring", size=4)

    ring = jax.shard_map(per_device, mesh=mesh, in_specs=(tokens, tokens, PartitionSpec(), tokens),
                         out_specs=tokens)
    zigzag = functools.partial(jax.tree.map, lambda x: x[:, order])
    restore = functools.partial(jax.tree.map, lambda x: np.asarray(x)[:, np.argsort(order)])
    out, pullback = jax.vjp(jax.jit(lambda q, latent, w: ring(q, latent, w, segments[:, order])), *zigzag((q, latent)),
                            w)
    dq, d_latent, dw = pullback(zigzag(do))
    want, want_pullback = jax.vjp(reference, q, latent, w)
    got = {"out": restore(out), "dq": restore(dq), "dc": restore(d_latent[0]), "dk_rope": restore(d_latent[1]),
           "dw": dw}
    want_dq, (want_dc, want_dk_rope), want_dw = want_pullback(do)
    for name, w_ in zip(got, [want, want_dq, want_dc, want_dk_rope, want_dw]):
        np.testing.assert_allclose(got[name], w_, rtol=1e-5, atol=1e-5 * float(np.abs(w_).max()), err_msg=name)


@pytest.mark.fast
def test_auto_takes_cudnn_for_values_of_their_own_size_within_its_limits():
    choose = dict(impl="auto", platform="gpu", dtype=jnp.bfloat16, seq_len=4096, head_dim=192)
    assert choose_kernel(**choose, value_head_dim=128) == "cudnn"  # DeepSeek's, padded to 192 in the step
    assert choose_kernel(**choose, value_head_dim=320) == "blockwise"
    q, v = jnp.zeros((1, 8, 2, 24)), jnp.zeros((1, 8, 2, 16))
    # the step pads both sides to the larger size and cuts the output back to the values'
    o, lse = jax.eval_shape(lambda q, v: CudnnStep(4).forward(q, q, v, None, True), q, v)
    assert o.shape == (1, 8, 2, 16) and lse.shape == (1, 2, 8)


# -- Hugging Face: jlong convert both ways, and what is refused


@pytest.mark.parametrize("name", ["deepseek-v3", "glm4-moe-lite"])
def test_convert_writes_back_a_checkpoint_transformers_reads_to_the_same_logits(name, tmp_path):
    """HF -> jlong checkpoint -> HF keeps every tensor (the rotary columns back in interleaved pairs, the
    correction bias), and transformers' model of what jlong wrote gives jlong's logits."""
    hf_model = small_hf_model(name)
    hf_model.save_pretrained(tmp_path / "hf")
    assert run_cli("convert", tmp_path / "hf", tmp_path / "jlong").returncode == 0
    assert run_cli("convert", tmp_path / "jlong", tmp_path / "back").returncode == 0
    back = type(hf_model).from_pretrained(tmp_path / "back").eval()
    for key, tensor in hf_model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), tensor.numpy(), err_msg=key)
    tokens = np.random.default_rng(1).integers(0, 96, (2, 70))
    jlong_logits = np.asarray(jlong.from_hf(tmp_path / "hf")(jnp.asarray(tokens)))
    np.testing.assert_allclose(hf_logits(back, tokens), jlong_logits, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek-v3")
    small_hf_model("deepseek-v3").save_pretrained(path)
    return path


def _edited(source, target, **changes):
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    config = {**json.loads((source / "config.json").read_text()), **changes}
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.fast
@pytest.mark.parametrize("changes, message", [
    ({"rope_interleave": False}, "rope_interleave=false (rotary dimensions in halves) is not read"),
    ({"scoring_func": "softmax"}, "scoring_func 'softmax' with topk_method None is not deepseek_v3's routing"),
    ({"topk_method": "greedy"}, "topk_method 'greedy' is not deepseek_v3's routing"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not read"),
], ids=["halves", "softmax", "greedy", "partial-rotary"])
def test_a_checkpoint_the_family_does_not_implement_is_one_line(changes, message, deepseek_dir, tmp_path):
    edited = _edited(deepseek_dir, tmp_path / "edited", **changes)
    assert_one_line_error(run_cli("convert", edited, tmp_path / "out"), message)
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["model.head_dim=16"], "model.head_dim (16) must be qk_nope_head_dim + qk_rope_head_dim (24)"),
    (["model.num_key_value_heads=4"], "must be model.num_attention_heads (8)"),
    (["model.topk_group=5"], "model.n_group (4) must divide model.num_experts (8) and be at least"),
    (["model.topk_method=greedy"], "model.topk_method 'greedy' is not model.family=deepseek_v3's routing"),
    (["model.layer_types=[moe,dense]"], "has its dense layers first (first_k_dense_replace)"),
    (["model.family=deepseek_v2", "model.topk_method=greedy"], "never renormalises its top-k weights"),
])
def test_model_mistakes_are_one_line(overrides, message):
    with pytest.raises(JlongError, match=re.escape(message)):
        small_config(*TINY, *overrides)


# -- training on every sequence-parallel layout equals one device

LAYOUTS = {
    "sp4-fsdp2-stages": ["mesh.sp=4", "mesh.fsdp=2", "attention.heads_per_stage=4"],
    "ring2-sp2-fsdp2": ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2", "attention.heads_per_stage=4"],
    "allgather-sp4-fsdp2": ["mesh.sp=4", "mesh.fsdp=2", "attention.sp_method=allgather",
                            "attention.heads_per_stage=4"],
}
# Ulysses' head stages in CI; the ring's and the all-gather's kernels with values of their own size are the
# kernel tests' above, so their whole training steps (40 s each on the CI machine) are the slow tier's.
LAYOUT_CASES = ["sp4-fsdp2-stages", *(pytest.param(name, marks=pytest.mark.slow)
                                      for name in ("ring2-sp2-fsdp2", "allgather-sp4-fsdp2"))]


def _far_routing(params):
    """Routers scaled up (a sigmoid's scores spread, never saturated) and correction biases as wide as the
    scores' spread, so that no top-k is a near tie rounding could decide and the biases change choices."""
    layers = params["layers"]
    layers["router"] = layers["router"] * 5.0
    bias = layers["router_correction_bias"]
    layers["router_correction_bias"] = 0.2 * jax.random.normal(jax.random.PRNGKey(3), bias.shape, bias.dtype)
    return params


@pytest.fixture(scope="module")
def one_device():
    return loss_and_grads(small_config(*TINY), jax.devices()[:1], adjust=_far_routing)


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_training_on_a_mesh_equals_one_device(layout, one_device):
    """Loss (with the load-balancing loss) and every gradient of packed documents (data.eos_id), rtol 1e-5:
    Ulysses in 2 stages of 4 of the 8 up-projected heads, Ulysses across a ring, the all-gather method."""
    sharded = loss_and_grads(small_config(*TINY, *LAYOUTS[layout]), jax.devices(), adjust=_far_routing)
    assert_same_result(sharded, one_device)
    grads = sharded[1]["layers"]
    for name in ("wq_b", "wkv_a", "wkv_b", "wo", "router", "shared_down"):
        assert np.abs(grads[name]).max() > 0, name
    assert not np.abs(grads["router_correction_bias"]).max()  # it chooses, never weighs


def _collective_operands(config) -> dict[str, set[tuple[int, ...]]]:
    """The operand shapes of each sequence-parallel collective in the training step's program (the shard_maps'
    explicit ones: the lowered program, before XLA partitions the rest)."""
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()))
    params = program.init_params(seed=0)
    batch = program.place_batch(Batches.from_config(config).batch(1))
    text = jax.jit(jax.value_and_grad(program.loss)).lower(params, batch).as_text()
    return {op: {tuple(int(n) for n in shape.split("x")[:-1])
                 for shape in re.findall(rf'"stablehlo\.{op}"\(.*?\) .*?: \(tensor<([^>]*)>', text)}
            for op in ("all_gather", "collective_permute")}


@pytest.mark.parametrize("layout, stage, collective, moved", [
    ("allgather-sp4-fsdp2", 4, "all_gather", "latent"),
    ("ring2-sp2-fsdp2", 4, "collective_permute", "latent"),
    ("ring2-sp2-fsdp2", 2, "collective_permute", "heads")], ids=["allgather", "ring", "ring-one-head"])
def test_what_travels_is_the_latent_where_it_is_narrower(layout, stage, collective, moved):
    """The all-gather and the ring move the latent, c [Rkv = 32] and the rotary key [dr = 8] per token (and
    the segment ids), where it is narrower than the heads' keys and values a device receives per stage: the
    all-gather's 8 heads (8 x (24 + 16) values per token), the ring's 2 heads per device; one head per device
    (40 values per token, as many as the latent's) moves the heads' keys and values."""
    config = small_config(*TINY, *LAYOUTS[layout], f"attention.heads_per_stage={stage}")
    shapes = _collective_operands(config)[collective]
    per_token = {shape[2:] for shape in shapes}
    assert per_token == ({(32,), (8,), ()} if moved == "latent" else {(1, 24), (1, 16), ()}), shapes


@pytest.mark.fast
@pytest.mark.parametrize("layout, line", [
    (["mesh.ring=2", "mesh.sp=4", "attention.heads_per_stage=20"],
     "keys and values move as the latent (the ring, per stage): 576 values per token for the latent, 2,560 for "
     "the 5 heads a device receives"),
    (["mesh.ring=2", "mesh.sp=4", "attention.heads_per_stage=4"],
     "keys and values move as the up-projected keys and values (the ring, per stage): 576 values per token for "
     "the latent, 512 for the 1 head a device receives"),
    (["mesh.sp=8", "attention.sp_method=allgather"],
     "keys and values move as the latent (the all-gather, per layer): 576 values per token for the latent, "
     "10,240 for the 20 heads a device receives"),
    (["mesh.sp=4"], None)], ids=["ring", "ring-one-head", "allgather", "ulysses"])
def test_the_plan_says_what_travels(layout, line):
    """GLM-4.7-Flash's latent is 512 + 64 values per token, a head's key and value 256 + 256: `jlong plan`
    says which the layout moves, by the rule the methods follow; Ulysses alone moves the heads, unsaid."""
    from jlong.planner.memory import describe_latent_exchange

    config = load_config(None, ["model.preset=glm-4.7-flash", "train.seq_len=1048576", *layout])
    assert describe_latent_exchange(config) == line


# -- generation


@pytest.mark.parametrize("name", ["deepseek-v3", "glm4-moe-lite"])
def test_greedy_decoding_is_transformers_argmax(name, tmp_path):
    """The sampler's prefill and one-query decode (which take the heads padded to one size) on one device:
    each greedy token is the argmax of transformers' forward over prompt + completion, its logprob within 1e-4."""
    from jlong.generation.sampler import Request, Sampler
    from jlong.generation.sampling import SamplingSettings
    from jlong.parallel.placement import make_mesh
    from jlong.program.train_program import TrainProgram

    hf_model = small_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    config = load_config(None, [f"model.hf_path={tmp_path}", "train.seq_len=64", "train.batch_size=2",
                                "train.compute_dtype=float32", "attention.block_size=16", "data.source=synthetic"])
    program = TrainProgram(config, make_mesh(config.mesh, jax.devices()[:1]))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 96, n).tolist() for n in (37, 9)]
    completions = Sampler(program).generate(program.starting_params(), prompts,
                                            Request(6, SamplingSettings(temperature=0.0)))
    for completion in completions:
        prompt = prompts[completion.prompt_index]
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + completion.ids])).logits[0].double()
        reference = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()
        assert len(completion.ids) == 6
        for step, (token, logprob) in enumerate(zip(completion.ids, completion.logprobs)):
            assert reference[step, token] >= reference[step].max() - 1e-5, (completion.prompt_index, step)
            assert abs(reference[step, token] - logprob) < 1e-4, (completion.prompt_index, step)


# -- presets


def _sizes(model) -> tuple[float, float]:
    """(parameters, parameters a token runs through: all but the idle routed experts), in billions."""
    family = family_of(model)
    specs = family.layer_params(model)
    counts = {name: math.prod(spec.shape) * family.layers_with(model, spec) for name, spec in specs.items()}
    total = sum(counts.values()) + sum(math.prod(s.shape) for s in family.outer_params(model).values())
    experts = sum(count for name, count in counts.items() if name.startswith("expert_"))
    return total / 1e9, (total - experts * (1 - model.num_experts_per_tok / model.num_experts)) / 1e9


@pytest.mark.fast
def test_presets_hold_their_published_sizes():
    """DeepSeek-V2-Lite: 15.7B parameters, 2.4B activated (DeepSeek-V2 paper, model card; the activated
    without the embedding). Moonlight-16B-A3B: 15.29B, 2.24B activated, both without the embedding and the
    output layer (Moonshot's paper, arXiv 2502.16982). GLM-4.7-Flash: "30B-A3B" (its model card; Hugging
    Face's 31B counts the multi-token-prediction layer transformers leaves out)."""
    sizes = {name: (load_config(None, [f"model.preset={name}"]).model) for name in
             ("deepseek-v2-lite", "moonlight-16b-a3b", "glm-4.7-flash")}
    embedding = {name: model.vocab_size * model.hidden_size for name, model in sizes.items()}
    total, active = _sizes(sizes["deepseek-v2-lite"])
    assert total == pytest.approx(15.7, abs=0.01)
    assert active - embedding["deepseek-v2-lite"] / 1e9 == pytest.approx(2.4, abs=0.06)  # 2.45
    total, active = _sizes(sizes["moonlight-16b-a3b"])
    assert total - 2 * embedding["moonlight-16b-a3b"] / 1e9 == pytest.approx(15.29, abs=0.005)
    assert active - 2 * embedding["moonlight-16b-a3b"] / 1e9 == pytest.approx(2.24, abs=0.005)
    total, active = _sizes(sizes["glm-4.7-flash"])
    assert total == pytest.approx(30, abs=0.1)  # 29.94
    assert active - 2 * embedding["glm-4.7-flash"] / 1e9 == pytest.approx(3, abs=0.3)  # 3.26
    for model in sizes.values():
        assert family_of(model).layer_types(model)[:2] == ("dense", "moe")


# The published config.json files (transformers 4's form), as Moonshot and DeepSeek ship them.
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163586, "ep_size": 1, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11264,
    "kv_lora_rank": 512, "max_position_embeddings": 8192, "model_type": "deepseek_v3", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": True,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
    "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
    "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.46.3", "use_cache": True,
    "v_head_dim": 128, "vocab_size": 163840,
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2", "moe_intermediate_size": 1408,
    "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2, "norm_topk_prob": False,
    "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.39.3", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}


@pytest.mark.fast
@pytest.mark.parametrize("published, preset", [(MOONLIGHT, "moonlight-16b-a3b"),
                                               (DEEPSEEK_V2_LITE, "deepseek-v2-lite")])
def test_the_published_config_json_is_the_preset(published, preset, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(published))
    read = model_config_from_hf(tmp_path).model_dump(exclude={"preset", "hf_path"})
    assert read == load_config(None, [f"model.preset={preset}"]).model.model_dump(exclude={"preset", "hf_path"})


@pytest.mark.fast
def test_the_padded_output_projection_of_lora_adapters_adds_zero_rows_to_the_frozen_weight_and_a():
    """cuDNN's one head size pads `wo` [H, dv, D]; with LoRA it is an Adapted weight whose `a` [H, dv, r] takes
    the same zero rows, so the padded values' zero columns add nothing to the output."""
    from jlong.attention.latent import LatentProjection
    from jlong.ops import adapted

    rng = np.random.default_rng(0)
    heads, dq, dv, model_dim, rank = 2, 24, 16, 8, 4
    wo = adapted.Adapted(jnp.asarray(rng.normal(size=(heads, dv, model_dim)), jnp.float32),
                         jnp.asarray(rng.normal(size=(heads, dv, rank)), jnp.float32),
                         jnp.asarray(rng.normal(size=(rank, model_dim)), jnp.float32), inputs=2)
    projection = LatentProjection(norm_eps=1e-6, rope_inv_freq=(1.0,), qk_nope_head_dim=20, kv_lora_rank=8,
                                  one_head_size=True)
    padded = projection.padded_output({"wq": jnp.zeros((model_dim, heads, dq)), "wo": wo})["wo"]
    assert padded.w.shape == (heads, dq, model_dim) and padded.a.shape == (heads, dq, rank)
    o = jnp.asarray(rng.normal(size=(3, heads, dv)), jnp.float32)
    o_padded = jnp.pad(o, ((0, 0), (0, 0), (0, dq - dv)))
    np.testing.assert_allclose(adapted.matmul(o_padded, padded, inputs=2), adapted.matmul(o, wo, inputs=2),
                               rtol=1e-6, atol=1e-6)


# -- LoRA: all-linear takes the latent projections and the shared experts, as PEFT's all-linear does


def _peft_all_linear_keys(hf_model) -> set[str]:
    """The lora_A and lora_B tensors PEFT's own all-linear puts on `hf_model`, by the names it saves them under."""
    import peft

    adapted = peft.get_peft_model(hf_model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return {name.replace(".default.", ".") for name, _ in adapted.named_parameters() if "lora_" in name}


@pytest.mark.fast
@pytest.mark.parametrize("name", ["deepseek-v3", "glm4-moe-lite"])
def test_all_linear_adapts_what_peft_all_linear_does(name, tmp_path):
    """jlong's all-linear on a tiny checkpoint adapts every nn.Linear of transformers' layers: the attention
    projections PEFT's all-linear adapts (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), and the
    dense MLP and the shared experts, which PEFT 0.21 on transformers 5 takes for the routed experts' fused
    parameters (by their names gate_proj, up_proj, down_proj; `peft_caveat` says so); not the routers or routed
    experts. Each adapter's PEFT layout is its merged weight's: for random a, b, the family's Hugging Face table
    turns w + a @ b into W + B @ A (the rotary rows of B in the checkpoint's interleaved order, A's columns in no
    other order)."""
    from jlong.lora.peft_format import adapter_shapes, peft_caveat, peft_tensors
    from jlong.lora.targets import lora_settings

    hf_model = small_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    model = model_config_from_hf(tmp_path)
    lora = lora_settings(load_config(None, [f"model.hf_path={tmp_path}", "lora.rank=4"]).lora, model)
    mlp = {"w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down"}
    assert set(lora.targets) == {"wq_a", "wq_b", "wkv_a", "wkv_b", "wo", *mlp}
    rng = np.random.default_rng(0)
    adapters = {key: rng.normal(size=shape).astype(np.float32) for key, shape in adapter_shapes(model, lora).items()}
    written = peft_tensors(adapters, model, lora)
    linear = {f"{module}.lora_{side}.weight" for module, _ in hf_model.named_modules()
              if module.startswith("model.layers.") and isinstance(_, torch.nn.Linear) and ".experts." not in module
              for side in "AB"}
    assert set(written) == {"base_model.model." + key for key in linear}
    peft_keys = _peft_all_linear_keys(hf_model)
    assert {key for key in peft_keys if "mlp." not in key} == {key for key in written if ".self_attn." in key}
    assert not any(".shared_experts." in key or "mlp.gate_proj" in key for key in peft_keys)
    assert "leaves out these adapters of the dense layers' MLP and the shared experts" in peft_caveat(model, lora)

    tables = family_of(model).hf_layer_tensors(model)
    for target in lora.targets:
        a, b = adapters[target + "_lora_a"][0], adapters[target + "_lora_b"][0]
        module = tables[target].name.removesuffix(".weight")
        prefix = min(key for key in written if key.endswith(f".{module}.lora_A.weight")).removesuffix(".lora_A.weight")
        product = np.tensordot(a, b, axes=1).reshape(family_of(model).layer_params(model)[target].shape)
        np.testing.assert_allclose(written[f"{prefix}.lora_B.weight"] @ written[f"{prefix}.lora_A.weight"],
                                   tables[target].to_hf(product), rtol=1e-5, atol=1e-5, err_msg=target)


@pytest.fixture(scope="module")
def lora_one_device():
    from test_lora import LORA, lora_loss_and_grads

    return lora_loss_and_grads(small_config(*TINY, *LORA), jax.devices()[:1], adjust=_far_routing)


# The ring's whole LoRA training step is the slow tier's, as its full-training counterpart above.
@pytest.mark.slow
def test_lora_on_the_latent_ring_equals_one_device(lora_one_device):
    """all-linear LoRA (B random) on ring 2 x sp 2 x fsdp 2, 2 heads a device per stage, so that the latent
    travels and each device up-projects it through the adapted W_kv_b of its heads (the ring's backward
    differentiates that weight's adapters alone): loss and every adapter's gradient equal one device's (rtol
    1e-5), and every adapter of the latent projections and shared experts has a gradient."""
    from test_lora import LORA, lora_loss_and_grads

    config = small_config(*TINY, *LORA, *LAYOUTS["ring2-sp2-fsdp2"])
    moved = {shape[2:] for shape in _collective_operands(config)["collective_permute"]}
    assert moved == {(32,), (8,), ()}  # the latent (c, the rotary key) and the segment ids, no heads
    got = lora_loss_and_grads(config, jax.devices(), adjust=_far_routing)
    grads = got[1]["layers"]
    assert set(grads) == set(lora_one_device[1]["layers"])
    for name in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "shared_gate", "shared_up", "shared_down", "w_gate"):
        for side in ("_lora_a", "_lora_b"):
            assert np.abs(grads[name + side]).max() > 0, name + side
    assert_same_result(got, lora_one_device)


ATTENTION_TARGETS = "lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]"


def test_convert_writes_lora_adapters_that_peft_and_transformers_read_to_jlongs_logits(tmp_path):
    """A GLM-4.7-Flash-shaped LoRA run's checkpoint (adapters with B random) through `jlong convert`: PEFT's
    model of the adapter directory over transformers' model (the latent projections and o_proj; B's rotary rows
    of q_b_proj and kv_a_proj_with_mqa back in interleaved pairs) gives jlong's logits within 1e-4, and so does
    transformers' model of the all-linear run's merged checkpoint (`--merge`: the dense MLP and the shared
    experts too, which PEFT would not load)."""
    import peft
    import transformers

    from jlong.checkpoint import Checkpoints
    from jlong.lora.peft_format import read_adapters
    from test_lora import LORA, _nonzero_b

    hf_model = small_hf_model("glm4-moe-lite")
    hf_model.save_pretrained(tmp_path / "hf")
    tokens = np.random.default_rng(1).integers(0, 96, (2, 24))
    base_logits = hf_logits(hf_model, tokens)
    for run, targets in {"attention": [ATTENTION_TARGETS], "all-linear": []}.items():
        config = load_config(None, [f"model.hf_path={tmp_path / 'hf'}", "train.seq_len=32", "train.batch_size=2",
                                    "train.compute_dtype=float32", "data.source=synthetic", *LORA, *targets])
        program = TrainProgram(config, make_mesh(config.mesh, jax.devices()[:1]))
        params = _nonzero_b(program.load_hf_params(tmp_path / "hf"))
        want = np.asarray(program.bind(params)(jnp.asarray(tokens)))
        assert np.abs(want - base_logits).max() > 0.01  # the adapters matter
        checkpoints = Checkpoints(tmp_path / run / "ckpt")
        checkpoints.save(1, jax.tree.map(np.asarray, program.saved(params)), model=config.model,
                         extra={"lora": {**config.lora.model_dump(mode="json"), "hf_path": str(tmp_path / "hf")}})
        checkpoints.close()
        if run == "attention":
            result = run_cli("convert", tmp_path / run / "ckpt", tmp_path / run / "adapter")
            assert result.returncode == 0, result.stderr
            base = transformers.Glm4MoeLiteForCausalLM.from_pretrained(tmp_path / "hf").eval()
            adapted = peft.PeftModel.from_pretrained(base, tmp_path / run / "adapter").eval()
            got = adapted(torch.as_tensor(tokens)).logits.detach().numpy()
            read = read_adapters(tmp_path / run / "adapter", program)["layers"]  # the reader undoes the reorder
            for key, value in program.saved(params)["layers"].items():
                np.testing.assert_allclose(read[key], np.asarray(value), rtol=1e-6, atol=1e-7, err_msg=key)
        else:
            result = run_cli("convert", tmp_path / run / "ckpt", tmp_path / run / "merged", "--merge")
            assert result.returncode == 0, result.stderr
            got = hf_logits(transformers.Glm4MoeLiteForCausalLM.from_pretrained(tmp_path / run / "merged").eval(),
                            tokens)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=run)
