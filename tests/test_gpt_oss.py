"""GPT-OSS (`gpt_oss`) through the family seam: OpenAI's MXFP4 checkpoints
read as transformers dequantizes them, with transformers' logits (sinks far
from zero, windows shorter than the sequence, the SwiGLU clamp acting,
router and expert biases, YaRN), and one-line errors for parts that do not
fit; the published config.json read as the preset; training on sp x fsdp,
ring x sp x fsdp and all-gather meshes equal to one device; the presets'
sizes; one-line config errors.

The bf16 form's logits and its exact round trip are test_hf_parity's
(`gpt-oss` is among tests/hf_models.py's architectures), its load-balancing
loss test_moe's."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from helpers import leaf_at, loss_and_grads, small_config
from hf_models import hf_logits, small_hf_model
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import jlong
from jlong.config import load_config
from jlong.errors import JlongError
from jlong.families import family_of
from jlong.hf import model_config_from_hf
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram

TINY = ["model.preset=tiny-gpt-oss", "model.intermediate_size=32", "model.num_key_value_heads=2",
        "model.swiglu_limit=0.2", "data.eos_id=7", "train.seq_len=128", "train.batch_size=2"]
PROJECTIONS = ("gate_up_proj", "down_proj")
# As OpenAI's config.json names what stays unquantized.
QUANTIZATION = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _mxfp4_checkpoint(path, seed=0):
    """The tiny GPT-OSS of tests/hf_models.py saved as OpenAI publishes its checkpoints: each layer's experts as
    random MXFP4 blocks [E, rows, cols / 32, 16] and E8M0 scales [E, rows, cols / 32] (weights up to 6 x 2^-5),
    the rest as they are. Returns the quantized tensors by name."""
    hf_model = small_hf_model("gpt-oss")
    hf_model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION}))
    tensors = {name: t.contiguous() for name, t in hf_model.state_dict().items() if not name.endswith(PROJECTIONS)}
    rng = np.random.default_rng(seed)
    quantized = {}
    for name, parameter in hf_model.state_dict().items():
        if name.endswith(PROJECTIONS):
            E, cols, rows = parameter.shape  # transformers' parameter is the stored matrix transposed
            quantized[f"{name}_blocks"] = torch.from_numpy(rng.integers(0, 256, (E, rows, cols // 32, 16), np.uint8))
            quantized[f"{name}_scales"] = torch.from_numpy(rng.integers(118, 123, (E, rows, cols // 32), np.uint8))
    (path / "model.safetensors").unlink()
    save_file({**tensors, **quantized}, path / "model.safetensors", metadata={"format": "pt"})
    return quantized


def test_an_mxfp4_checkpoint_is_read_as_transformers_dequantizes_it_and_gives_its_logits(tmp_path):
    """The experts equal transformers' own dequantization (`convert_moe_packed_tensors`) exactly, in float32 and
    in bfloat16; the logits over 24 tokens (an 8-token window) equal those of transformers' model loaded from the
    same files (dequantized); written back, the checkpoint is a plain one transformers loads with those weights."""
    quantized = _mxfp4_checkpoint(tmp_path / "mxfp4")
    model = jlong.from_hf(tmp_path / "mxfp4")
    in_bf16 = jlong.from_hf(tmp_path / "mxfp4", param_dtype="bfloat16")
    for dtype, loaded in ((torch.float32, model), (torch.bfloat16, in_bf16)):
        layers = nnx.to_pure_dict(nnx.state(loaded))["layers"]
        for i in range(model.config.num_hidden_layers):
            for param, projection in (("expert_gate_up", "gate_up_proj"), ("expert_down", "down_proj")):
                name = f"model.layers.{i}.mlp.experts.{projection}"
                want = convert_moe_packed_tensors(quantized[f"{name}_blocks"], quantized[f"{name}_scales"], dtype=dtype)
                np.testing.assert_array_equal(np.asarray(layers[param][i], np.float32), want.float().numpy(),
                                              err_msg=f"{name} {dtype}")

    hf_model = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    tokens = np.random.default_rng(1).integers(0, 96, (2, 24))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), rtol=1e-4,
                               atol=1e-4)

    jlong.to_hf(model, tmp_path / "plain")
    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    plain = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "plain").eval()
    for name, tensor in hf_model.state_dict().items():
        np.testing.assert_array_equal(plain.state_dict()[name].numpy(), tensor.numpy(), err_msg=name)


@pytest.mark.fast
def test_mxfp4_parts_that_do_not_fit_are_a_one_line_error(tmp_path):
    quantized = _mxfp4_checkpoint(tmp_path)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    quantized[name] = quantized[name][:, :-1].contiguous()
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
    save_file({**tensors, **quantized}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(JlongError, match=r"MXFP4 tensor model.layers.1.mlp.experts.down_proj: blocks \(8, 64, 1, "
                                         r"16\) and scales \(8, 63, 1\) are not"):
        jlong.from_hf(tmp_path)


# openai/gpt-oss-20b's config.json as published (transformers 4's form), its 24 layer types written out below.
PUBLISHED_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999, "quantization_config": QUANTIZATION,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}


@pytest.mark.fast
def test_the_published_config_json_is_the_preset(tmp_path):
    """The checkpoint's config.json (no swiglu_alpha: transformers' default) reads as configs/models/gpt-oss-20b."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED_20B))
    read = model_config_from_hf(tmp_path).model_dump(exclude={"preset", "hf_path", "layer_types"})
    preset = load_config(None, ["model.preset=gpt-oss-20b"]).model
    assert read == preset.model_dump(exclude={"preset", "hf_path", "layer_types"})
    assert family_of(preset).layer_types(preset) == tuple(PUBLISHED_20B["layer_types"])


def _far_sinks_sharp_routers(params):
    """Sinks far from zero (std 2, from the initial 0.02), and routers scaled up so that no token's top-k is a
    near tie that rounding could flip."""
    layers = params["layers"]
    layers["attn_sinks"] = layers["attn_sinks"] * 100.0
    layers["router"] = layers["router"] * 50.0
    return params


@functools.cache
def _one_device():
    """The one-device reference of the tiny model, computed once per test process."""
    return loss_and_grads(small_config(*TINY), jax.devices()[:1], _far_sinks_sharp_routers)


@pytest.mark.parametrize("layout", [
    ["mesh.sp=4", "mesh.fsdp=2", "attention.heads_per_stage=4"],
    ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2", "memory.remat=offload_inputs"],
    ["attention.sp_method=allgather", "mesh.sp=4", "mesh.fsdp=2"],
], ids=["sp4-fsdp2-U4", "ring2-sp2-fsdp2", "allgather-sp4-fsdp2"])
def test_training_on_a_mesh_equals_one_device(layout):
    """Loss (with the load-balancing loss) and every gradient, the sinks' included, of packed documents
    (data.eos_id) over 128 tokens: a sliding layer (8 tokens) and a full one in two head stages over sp (two
    kv heads replicated over four devices), on the ring's halos, and under all-gather (the window within half
    a device's chunk: the neighbours' halos, no gather)."""
    config = small_config(*TINY, *layout)
    sharded = loss_and_grads(config, jax.devices(), _far_sinks_sharp_routers)
    _assert_same_up_to_rounding(sharded, _one_device())
    grads = sharded[1]["layers"]
    for name in ("attn_sinks", "bo", "router_bias", "expert_gate_up_bias", "expert_down", "wq"):
        assert all(np.abs(grads[name][i]).max() > 0 for i in range(config.model.num_hidden_layers)), name


def test_allgather_windows_within_half_a_chunk_gather_no_keys():
    """One sliding layer under all-gather on sp 4, its loss lowered from abstract inputs: at 128 tokens the
    8-token window fits in half of a device's chunk (16 tokens), so its keys and values come as the
    neighbours' halos (collective permutes) and nothing is all-gathered; at 32 tokens (4 per half chunk) the
    window reaches further, and they are gathered."""
    collectives = {}
    for seq_len in (128, 32):
        config = small_config(*TINY, "attention.sp_method=allgather", "mesh.sp=4", "mesh.fsdp=2",
                              "model.num_hidden_layers=1", "model.layer_types=[sliding_attention]",
                              f"train.seq_len={seq_len}")
        program = TrainProgram(config, make_mesh(config.mesh, jax.devices()))
        text = jax.jit(program.loss).lower(program.abstract_params, program.abstract_batch).as_text()
        collectives[seq_len] = text.count("stablehlo.all_gather"), text.count("stablehlo.collective_permute")
    (halo_gathers, halo_permutes), (gathers, permutes) = collectives[128], collectives[32]
    assert halo_gathers == 0 and halo_permutes > 0
    assert gathers > 0 and permutes == 0


def _assert_same_up_to_rounding(got, want):
    """`helpers.assert_same_result`, each gradient's absolute tolerance its largest entry's float32 rounding
    (1e-6 of it): an output bias's gradient sums every token's, and on a mesh the sum runs in another order
    (bo's entries of ~0.4 came out 2e-7 apart on all-gather)."""
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        expected = leaf_at(want_grads, path)
        np.testing.assert_allclose(leaf, expected, rtol=1e-5, atol=max(1e-7, 1e-6 * float(np.abs(expected).max())),
                                   err_msg=jax.tree_util.keystr(path))


def _parameters(model) -> tuple[int, int]:
    """(every parameter, the active ones by OpenAI's count: all but the input embedding, and of each layer's
    experts, their matrices' and biases', the share a token is routed to)."""
    family = family_of(model)
    specs = family.layer_params(model)
    counts = {name: math.prod(spec.shape) * family.layers_with(model, spec) for name, spec in specs.items()}
    total = sum(counts.values()) + sum(math.prod(s.shape) for s in family.outer_params(model).values())
    experts = sum(count for name, count in counts.items() if name.startswith("expert_"))
    idle = experts * (1 - model.num_experts_per_tok / model.num_experts)
    return total, total - model.vocab_size * model.hidden_size - idle


@pytest.mark.fast
@pytest.mark.parametrize("name, billions, active", [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)])
def test_presets_hold_their_published_sizes(name, billions, active):
    """OpenAI's model card: 20.91B parameters of which 3.61B active, 116.83B of which 5.13B; layers alternate a
    128-token window and full attention, sliding first."""
    model = load_config(None, [f"model.preset={name}"]).model
    total, active_count = _parameters(model)
    assert total / 1e9 == pytest.approx(billions, abs=0.005)
    assert active_count / 1e9 == pytest.approx(active, abs=0.005)
    family = family_of(model)
    assert family.layer_types(model)[:2] == ("sliding_attention", "full_attention")
    assert family.windows(model) == {128} and family.scanned_runs(model) == [2]


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["model.num_experts_per_tok=9"], "more than model.num_experts"),
    (["model.moe_intermediate_size=32"], "experts are of model.intermediate_size"),
    (["model.norm_topk_prob=true"], "drop model.norm_topk_prob"),
    (["model.qk_norm=true"], "has no q/k norms"),
    (["model.swiglu_limit=null"], "needs model.swiglu_limit"),
    (["model.swiglu_alpha=0"], "swiglu_alpha must be positive"),
    (["model.layer_types=[sliding_attention,moe]"], "moe is not a GPT-OSS layer type"),
    (["mesh.ring=4"], "model.sliding_window (8) is longer than the 4 tokens of each zigzag chunk"),
])
def test_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(JlongError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        small_config(*TINY, "train.seq_len=32", *overrides)
    assert "\n" not in str(error.value)


@pytest.mark.fast
def test_another_family_refuses_the_swiglu_limit():
    with pytest.raises(JlongError, match="model.swiglu_limit is not part of model.family=llama"):
        small_config("model.swiglu_limit=7")
