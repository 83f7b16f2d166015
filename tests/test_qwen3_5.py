"""Qwen3.5: the gated delta rule's chunked form against the rule token by
token, the model against transformers, packed documents against documents
run alone, and every sequence-parallel layout against one device."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_same_result, loss_and_grads, small_config
from hf_models import QWEN3_5, hf_logits, perturbed_norms, small_hf_model

import jlong
from jlong.data.sources import Batches
from jlong.errors import JlongError
from jlong.families import family_of
from jlong.hf import model_config_from_hf
from jlong.linear_attention import chunks, gated_delta
from jlong.parallel.placement import make_mesh
from jlong.program.train_program import TrainProgram

# Every second layer full attention: the layers repeat with a period of two (one loop over the periods).
TINY = ["model.preset=tiny-qwen3.5", "model.vocab_size=128", "model.num_hidden_layers=4", "model.hidden_size=64",
        "model.intermediate_size=128", "model.num_key_value_heads=2", "model.full_attention_interval=2",
        "data.eos_id=7", "train.batch_size=2"]


def _tiny(*overrides):
    return small_config(*TINY, *overrides)


def _rule_inputs(B=2, S=150, Hk=2, H=4, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q, k = (unit(rng.normal(size=(B, S, Hk, dk))).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(B, S, H, dv)).astype(np.float32)
    g = (-0.3 * np.abs(rng.normal(size=(B, S, H)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, S, H))))).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.fast
@pytest.mark.parametrize("chunk, per_block", [(16, 3), (64, 16)])
def test_the_chunked_rule_equals_the_rule_token_by_token(chunk, per_block):
    """Across chunk and block boundaries, with padding at the end, packed
    documents, a given starting state, and in its gradients."""
    q, k, v, g, beta = _rule_inputs()
    segments = np.repeat(np.array([[0, 1, 2]]), [40, 70, 40], axis=1).repeat(2, 0).astype(np.int32)
    state = np.random.default_rng(1).normal(size=(2, 4, 16, 8)).astype(np.float32)
    chunked = lambda *a: gated_delta.chunked(*a, chunk=chunk, chunks_per_block=per_block)  # noqa: E731
    for args in [(), (segments,), (segments, state), (segments, state, np.array([5, 0]))]:
        got, want = chunked(q, k, v, g, beta, *args), gated_delta.recurrent(q, k, v, g, beta, *args)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, atol=2e-6)
    loss = lambda rule: lambda q, g: rule(q, k, v, g, beta, segments, state)[0].sum()  # noqa: E731
    got = jax.grad(loss(chunked), argnums=(0, 1))(q, g)
    want = jax.grad(loss(gated_delta.recurrent), argnums=(0, 1))(q, g)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)


@pytest.mark.fast
def test_unit_lower_inverse_inverts():
    n = np.tril(np.random.default_rng(0).normal(size=(3, 64, 64)), -1).astype(np.float32) * 0.3
    got = chunks.unit_lower_inverse(jnp.asarray(n))
    np.testing.assert_allclose(got @ (np.eye(64) + n), np.broadcast_to(np.eye(64), n.shape), atol=1e-4)


@pytest.mark.fast
def test_unit_lower_inverses_gradient_is_autodiffs_through_the_doublings():
    """The inverse's own gradient (-X^T dX X^T, strictly lower) against autodiff through its computation."""
    rng = np.random.default_rng(1)
    n = jnp.asarray(np.tril(rng.normal(size=(3, 64, 64)), -1).astype(np.float32) * 0.3)
    cotangent = jnp.asarray(rng.normal(size=(3, 64, 64)).astype(np.float32))
    with jax.default_matmul_precision("highest"):
        (got,) = jax.vjp(chunks.unit_lower_inverse, n)[1](cotangent)
        (want,) = jax.vjp(chunks._doubling_inverse, n)[1](cotangent)
    want = jnp.tril(want, -1)  # the strictly lower part is all N has
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    assert float(jnp.abs(got).max()) > 0 and float(jnp.abs(jnp.triu(got)).max()) == 0


def test_logits_match_transformers_across_chunks_with_yarn(tmp_path):
    """150 tokens (three chunks of the rule), both layer types, value heads
    more than key heads, the output gate, partial RoPE scaled by YaRN."""
    rope = {**QWEN3_5["rope_parameters"], "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    hf_model = small_hf_model("qwen3.5", max_position_embeddings=512, rope_parameters=rope)
    hf_model.save_pretrained(tmp_path)
    model = jlong.from_hf(tmp_path)
    assert model.config.rope_scaling["rope_type"] == "yarn" and model.config.partial_rotary_factor == 0.25
    tokens = np.random.default_rng(1).integers(0, 96, (2, 150))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)


def test_layers_that_repeat_run_as_one_loop_over_periods_with_transformers_logits(tmp_path):
    """Qwen3.5-27B's 64 layers compile as one loop of 16 four-layer periods;
    a model scanned by its period gives transformers' logits."""
    from jlong.config import load_config
    from jlong.model.transformer import ForwardOptions, layer_groups

    [group] = layer_groups(load_config(None, ["model.preset=qwen3.5-27b"]).model, ForwardOptions())
    assert group.repeats == 16 and [o.layer_type for o in group.period] == ["linear_attention"] * 3 + [
        "full_attention"]
    hf_model = small_hf_model("qwen3.5", layer_types=["linear_attention", "full_attention"] * 2)
    hf_model.save_pretrained(tmp_path)
    model = jlong.from_hf(tmp_path)
    assert len(layer_groups(model.config, ForwardOptions())) == 1
    tokens = np.random.default_rng(1).integers(0, 96, (2, 70))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)


def test_the_text_model_of_an_image_text_checkpoint_matches_transformers(tmp_path, capfd):
    import torch
    import transformers

    text = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, **QWEN3_5)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    hf_model = perturbed_norms(transformers.Qwen3_5ForConditionalGeneration(config).eval())
    hf_model.save_pretrained(tmp_path)
    capfd.readouterr()
    model = jlong.from_hf(tmp_path)
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("jlong:")]
    assert len(notes) == 1 and "Qwen3.5 image-text checkpoint" in notes[0] and "vision tower is left out" in notes[0]
    assert model.config.family == "qwen3_5_text"
    tokens = np.random.default_rng(1).integers(0, 90, (2, 70))
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)


def test_packed_documents_equal_the_documents_run_alone(tmp_path):
    """Three documents in one row (the middle one crossing a chunk boundary)
    give each document's logits as if it ran alone: the rule's state and
    the convolution restart at each document, attention stays within it."""
    small_hf_model("qwen3.5").save_pretrained(tmp_path)
    model = jlong.from_hf(tmp_path)
    lengths = [30, 90, 40]
    tokens = np.random.default_rng(2).integers(0, 96, (1, sum(lengths)))
    segments = np.repeat(np.arange(3), lengths)[None]
    positions = np.concatenate([np.arange(n) for n in lengths])[None]
    packed = np.asarray(model(jnp.asarray(tokens), jnp.asarray(segments), jnp.asarray(positions)))
    start = 0
    for n in lengths:
        alone = np.asarray(model(jnp.asarray(tokens[:, start:start + n])))
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=1e-5)
        start += n


@functools.cache
def _one_device_at_256():
    """The reference every layout is compared with, computed once per test process."""
    return loss_and_grads(_tiny("train.seq_len=256"), jax.devices()[:1])


@pytest.mark.parametrize("layout", [
    ["mesh.sp=4", "mesh.fsdp=2", "attention.heads_per_stage=4", "kernels.gated_delta=triton"],
    pytest.param(["mesh.sp=4", "mesh.fsdp=2", "attention.heads_per_stage=all", "memory.remat=save_attention"],
                 marks=pytest.mark.slow),  # the long tier's: CI runs Ulysses in stages and the ring
    ["mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2", "memory.remat=offload_inputs", "kernels.gated_delta=triton"],
], ids=["sp4-fsdp2-U4-triton", "sp4-fsdp2-Uall", "ring2-sp2-fsdp2-triton"])
def test_training_on_a_mesh_equals_one_device(layout):
    """Loss and gradients of packed documents (data.eos_id) over 256 tokens
    (the rule's chunks across chunk boundaries: test_the_chunked_rule_...);
    with the GPU's Triton rule chosen, interpreted on the CPU (on the ring
    also in the ring's float32 summaries), against the one device's chunked
    rule."""
    sharded = loss_and_grads(_tiny("train.seq_len=256", *layout), jax.devices())
    assert_same_result(sharded, _one_device_at_256())
    grads = sharded[1]["layers"]
    assert np.abs(grads["gdn_a_log"]).max() > 0 and np.abs(grads["wq"]).max() > 0


def test_one_document_on_a_ring_x_sp_mesh_has_the_one_device_loss():
    """Without data.eos_id (no segment ids), each ring rank's group holds its own tokens' segments."""
    def loss(*overrides):
        config = _tiny("train.seq_len=256", "data.eos_id=null", *overrides)
        program = TrainProgram(config, make_mesh(config.mesh, jax.devices()[:config.mesh.size]))
        batch = program.place_batch(Batches.from_config(config).batch(1))
        return float(jax.jit(program.loss)(program.init_params(seed=0), batch))

    assert loss("mesh.ring=2", "mesh.sp=4") == pytest.approx(loss(), rel=1e-5)


@pytest.mark.fast
@pytest.mark.parametrize("overrides, message", [
    (["attention.sp_method=allgather", "mesh.sp=2"], "does not run linear-attention"),
    (["mesh.sp=8", "model.linear_num_value_heads=4"], "must be divisible by mesh.sp"),
    (["mesh.sp=4", "model.linear_num_key_heads=6", "model.linear_num_value_heads=24"], "straddle"),
    (["model.linear_num_value_heads=6", "model.linear_num_key_heads=4"], "must be a multiple of"),
    (["model.layer_types=[linear_attention,sliding_attention,linear_attention,full_attention]"],
     "sliding_attention is not a Qwen3.5 layer type"),
    (["model.num_hidden_layers=1"], "use model.num_hidden_layers=2, the fewest that has every layer type"),
    (["model.layer_types=[linear_attention,linear_attention,linear_attention,linear_attention]"],
     "name at least one full_attention layer"),
])
def test_linear_attention_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(JlongError, match=message) as error:
        _tiny(*overrides)
    assert "\n" not in str(error.value)


@pytest.mark.fast
def test_linear_layers_cost_linear_flops_and_full_layers_quadratic():
    model = _tiny().model
    family = family_of(model)
    assert family.layer_types(model).count("full_attention") == 2
    f = lambda n: family.flops_per_token(model, n)  # noqa: E731
    quadratic = 12 * model.num_attention_heads * model.dim_per_head / 2  # per token and token of length, one layer
    assert f(2048) - f(1024) == pytest.approx(2 * quadratic * 1024)


@pytest.mark.fast
def test_the_published_config_form_reads_as_transformers_does(tmp_path, capfd):
    """A config.json as Qwen publishes it: no layer_types (full_attention_interval),
    rope_parameters with partial_rotary_factor and multimodal sections, and
    multi-token-prediction layers, which jlong leaves out saying so in one line."""
    hf = small_hf_model("qwen3.5")
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("layer_types")
    config.update(full_attention_interval=2, mtp_num_hidden_layers=1)
    config["rope_parameters"].update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    capfd.readouterr()
    model = model_config_from_hf(tmp_path)
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("jlong:")]
    assert len(notes) == 1 and "multi-token-prediction" in notes[0] and "left out" in notes[0]
    assert family_of(model).layer_types(model) == ("linear_attention", "full_attention") * 2
    assert model.partial_rotary_factor == 0.25 and model.rope_scaling is None
