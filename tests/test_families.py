"""Model families: found by name (presets and config.json name them as
Hugging Face's model_type does), checked, and open to new ones registered
from outside jlong."""

import jax
import numpy as np
import pytest
from helpers import assert_same_result, loss_and_grads, small_config
from postnorm_family import POST_NORM_LLAMA

from jlong.config import load_config
from jlong.errors import JlongError
from jlong.families import family_of


@pytest.mark.fast
@pytest.mark.parametrize("preset, family", [("llama3-8b", "llama"), ("qwen2.5-14b", "qwen2"), ("qwen3-8b", "qwen3")])
def test_a_preset_names_its_family_as_model_type(preset, family):
    model = load_config(None, [f"model.preset={preset}"]).model
    assert model.family == family
    assert family_of(model).hf_config(model)["model_type"] == family


@pytest.mark.fast
def test_a_config_from_before_families_were_named_gets_the_family_its_flags_imply():
    inline = ["model.vocab_size=16", "model.hidden_size=32", "model.intermediate_size=64",
              "model.num_hidden_layers=1", "model.num_attention_heads=4"]
    assert load_config(None, inline).model.family == "llama"
    assert load_config(None, [*inline, "model.qk_norm=true"]).model.family == "qwen3"
    assert load_config(None, [*inline, "model.attention_bias=true"]).model.family == "qwen2"


@pytest.mark.fast
def test_family_mistakes_are_one_line():
    with pytest.raises(JlongError, match=r"model.family 'gpt9' is not a model family jlong knows \(known: .*llama"):
        small_config("model.family=gpt9")
    with pytest.raises(JlongError, match="model.qk_norm=false is not a qwen3 model"):
        small_config("model.family=qwen3", "model.qk_norm=false")


@pytest.mark.fast
def test_llama_flops_per_token_count_its_matrices_and_causal_attention():
    model = load_config(None, ["model.preset=llama3-8b"]).model
    D, F, L, V, S = 4096, 14336, 32, 128256, 131072
    H, K, d = 32, 8, 128
    matmul = L * (D * (H + 2 * K) * d + H * d * D + 3 * D * F) + D * V
    assert family_of(model).flops_per_token(model, S) == 6 * matmul + 6 * L * H * d * S


def test_a_family_registered_outside_jlong_trains_on_sp_x_ring_equal_to_one_device():
    """The test suite's post-norm Llama (`postnorm_family`, no line of jlong
    edited) on ring 2 x sp 2 x fsdp 2 equals one device, with packed
    documents; its own norms are in the gradients, and it is not Llama."""
    family = [f"model.family={POST_NORM_LLAMA.name}", "data.eos_id=7"]
    single = loss_and_grads(small_config(*family), jax.devices()[:1])
    sharded = loss_and_grads(small_config(*family, "mesh.ring=2", "mesh.sp=2", "mesh.fsdp=2"), jax.devices())
    assert_same_result(sharded, single)
    loss, grads = sharded
    assert np.abs(grads["layers"]["post_attn_norm"]).max() > 0
    assert np.abs(grads["layers"]["post_mlp_norm"]).max() > 0
    llama_loss, _ = loss_and_grads(small_config("data.eos_id=7"), jax.devices()[:1])
    assert abs(loss - llama_loss) > 1e-4
