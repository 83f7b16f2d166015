"""jlong's model equals Hugging Face transformers in float32, and round-trips exactly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_models import ARCHITECTURES, SCALED, hf_logits, small_hf_model

import jlong
from jlong.errors import JlongError



@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def hf_checkpoint(request, tmp_path_factory):
    model = small_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def _tokens(seq_len=70, batch=2, vocab=96):
    return np.random.default_rng(1).integers(0, vocab, (batch, seq_len))


@pytest.mark.fast
def test_logits_match_transformers(hf_checkpoint):
    hf_model, path = hf_checkpoint
    model = jlong.from_hf(path)
    tokens = _tokens()
    logits = jax.jit(lambda m, t: m(t))(model, jnp.asarray(tokens))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 70, 96)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf_model, tokens), rtol=0, atol=1e-4)


@pytest.mark.fast
def test_round_trip_is_exact(hf_checkpoint, tmp_path):
    hf_model, path = hf_checkpoint
    model = jlong.from_hf(path)
    jlong.to_hf(model, tmp_path / "out")
    reloaded_hf = type(hf_model).from_pretrained(tmp_path / "out").eval()
    for name, tensor in hf_model.state_dict().items():
        np.testing.assert_array_equal(reloaded_hf.state_dict()[name].numpy(), tensor.numpy(), err_msg=name)
    again = jlong.from_hf(tmp_path / "out")
    assert again.config.family == model.config.family
    for (name, a), (_, b) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(again))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(name))


@pytest.mark.fast
@pytest.mark.parametrize("name", SCALED)
def test_transformers4_config_form(name, tmp_path):
    """rope_theta / rope_scaling at the top level, as transformers 4 writes them
    (transformers 5's rope_parameters form is what the fixture saves)."""
    hf_model = small_hf_model(name)
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = jlong.from_hf(tmp_path)
    assert model.config.rope_scaling["rope_type"] == ARCHITECTURES[name][2]["rope_scaling"]["rope_type"]
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)


@pytest.mark.fast
@pytest.mark.parametrize("name", SCALED)
def test_rope_scaling_is_written_back(name, tmp_path):
    """A scaled model written by jlong loads in transformers with the same
    RoPE: its logits at 70 tokens (past the original 32) are the original's."""
    hf_model = small_hf_model(name)
    hf_model.save_pretrained(tmp_path / "hf")
    jlong.to_hf(jlong.from_hf(tmp_path / "hf"), tmp_path / "out")
    reloaded = type(hf_model).from_pretrained(tmp_path / "out").eval()
    tokens = _tokens()
    np.testing.assert_allclose(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens), rtol=0, atol=1e-6)


@pytest.mark.fast
def test_yarn_without_its_original_context_takes_the_checkpoints_as_transformers_does(tmp_path):
    yarn = {"rope_type": "yarn", "factor": 4.0}
    hf_model = small_hf_model("llama", rope_scaling=yarn, max_position_embeddings=40)
    hf_model.save_pretrained(tmp_path)
    model = jlong.from_hf(tmp_path)
    assert model.config.rope_scaling["original_max_position_embeddings"] == 40
    tokens = _tokens()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), hf_logits(hf_model, tokens), atol=1e-4)


@pytest.mark.fast
def test_unsupported_rope_scaling_is_one_line(tmp_path):
    small_hf_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JlongError, match="rope_type 'dynamic' is not supported; use one of linear, llama3, yarn"):
        jlong.from_hf(tmp_path)


@pytest.mark.fast
def test_sharded_checkpoint_is_read_and_written(tmp_path, monkeypatch):
    hf_model = small_hf_model("qwen2")
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = jlong.from_hf(tmp_path / "hf")
    monkeypatch.setattr(jlong.hf, "SHARD_BYTES", 30_000)
    jlong.to_hf(model, tmp_path / "out")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    tokens = _tokens()
    reloaded = type(hf_model).from_pretrained(tmp_path / "out").eval()
    np.testing.assert_array_equal(hf_logits(reloaded, tokens), hf_logits(hf_model, tokens))


@pytest.mark.fast
def test_missing_files_and_tensors_are_clear_errors(tmp_path):
    with pytest.raises(JlongError, match="has no config.json"):
        jlong.from_hf(tmp_path)
    small_hf_model("llama").save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(JlongError, match="no \\*.safetensors"):
        jlong.from_hf(tmp_path)


@pytest.mark.fast
def test_shape_mismatch_is_a_clear_error(tmp_path):
    small_hf_model("llama", intermediate_size=48).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 80
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(JlongError, match="mlp.gate_proj.weight has shape"):
        jlong.from_hf(tmp_path)


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "qwen3.5", "qwen3-moe", "qwen3.5-moe", "gpt-oss"])
def test_convert_command_round_trip(name, tmp_path):
    """HF -> jlong checkpoint -> HF through `jlong convert` keeps every tensor,
    and transformers' model loaded from what jlong wrote gives jlong's logits."""
    from jlong.cli import main

    hf_model = small_hf_model(name)
    hf_model.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "jlong")]) == 0
    assert main(["convert", str(tmp_path / "jlong"), str(tmp_path / "back")]) == 0
    back = type(hf_model).from_pretrained(tmp_path / "back").eval()
    for key, tensor in hf_model.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[key].numpy(), tensor.numpy(), err_msg=key)
    tokens = _tokens()
    jlong_logits = np.asarray(jlong.from_hf(tmp_path / "hf")(jnp.asarray(tokens)))
    np.testing.assert_allclose(hf_logits(back, tokens), jlong_logits, rtol=0, atol=1e-4)
