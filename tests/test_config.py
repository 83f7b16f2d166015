"""Config loading: presets, overrides, types, and one-line errors."""

import json

import math

import pytest

from jlong.config import load_config, preset_names
from jlong.errors import JlongError
from jlong.families import family_of

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)


def test_every_preset_loads_and_validates():
    names = preset_names()
    for required in ("llama3-8b", "llama3.1-8b", "llama3.2-1b", "llama3.2-3b",
                     "qwen2.5-14b", "qwen2.5-32b", "qwen3-8b", "qwen3-32b"):
        assert required in names
    for name in names:
        config = load_config(None, [f"model.preset={name}"])
        assert config.model.num_attention_heads % config.model.kv_heads == 0


def test_preset_numbers():
    llama = load_config(None, ["model.preset=llama3-8b"]).model
    assert (llama.hidden_size, llama.num_hidden_layers, llama.kv_heads, llama.vocab_size) == (4096, 32, 8, 128256)
    assert llama.rope_scaling is None and not llama.tie_word_embeddings
    assert load_config(None, ["model.preset=llama3.1-8b"]).model.rope_scaling["factor"] == 8.0
    qwen = load_config(None, ["model.preset=qwen3-32b"]).model
    assert (qwen.num_attention_heads, qwen.dim_per_head, qwen.qk_norm) == (64, 128, True)
    assert load_config(None, ["model.preset=qwen2.5-14b"]).model.attention_bias


def _parameters(model) -> int:
    """A model's parameters: each layer parameter over the layers that have it, and the outer ones."""
    family = family_of(model)
    total = sum(math.prod(s.shape) * family.layers_with(model, s) for s in family.layer_params(model).values())
    return total + sum(math.prod(s.shape) for s in family.outer_params(model).values())


@pytest.mark.parametrize("name, billions, layers", [("qwen3.5-0.8b", 0.75, 24), ("qwen3.5-9b", 8.95, 32),
                                                    ("qwen3.5-27b", 26.9, 64)])
def test_qwen3_5_presets_hold_their_published_sizes(name, billions, layers):
    """Their text models' parameters (the vision tower left out) and a full-attention layer every fourth."""
    model = load_config(None, [f"model.preset={name}"]).model
    family = family_of(model)
    assert _parameters(model) / 1e9 == pytest.approx(billions, abs=0.01)
    assert family.layer_types(model) == ("linear_attention",) * 3 + ("full_attention",) + \
        family.layer_types(model)[4:] and len(family.layer_types(model)) == layers
    assert family.layer_types(model).count("full_attention") == layers // 4


@pytest.mark.parametrize("name, billions, active", [
    ("qwen3-30b-a3b", 30.53, 3.35), ("qwen3-235b-a22b", 235.09, 22.19),
    ("qwen3.5-35b-a3b", 34.66, 3.45), ("qwen3.5-122b-a10b", 122.11, 9.77), ("qwen3.5-397b-a17b", 396.35, 17.35)])
def test_mixture_of_experts_presets_hold_their_published_sizes(name, billions, active):
    """Their text models' parameters, and the active ones: the routed experts' share of each layer's experts, the
    router, the rest, the output projection and the embedding (the sizes their names say)."""
    model = load_config(None, [f"model.preset={name}"]).model
    family = family_of(model)
    assert _parameters(model) / 1e9 == pytest.approx(billions, abs=0.01)
    embedding = model.vocab_size * model.hidden_size
    assert (family.matmul_params_per_token(model) + embedding) / 1e9 == pytest.approx(active, abs=0.01)


def test_inline_fields_override_the_preset(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: llama3.2-1b\n  num_hidden_layers: 2\ntrain:\n  seq_len: 4096\n")
    config = load_config(path, ["train.seq_len=5e6", "mesh.sp=8", "train.lr=1e-4"])
    assert config.model.num_hidden_layers == 2 and config.model.hidden_size == 2048
    assert config.train.seq_len == 5_000_000 and config.mesh.sp == 8 and config.train.lr == 1e-4


def test_heads_per_stage_defaults_to_sp():
    config = load_config(None, ["model.preset=llama3-8b", "mesh.sp=8"])
    assert config.heads_per_stage == 8
    assert load_config(None, ["model.preset=llama3-8b", "attention.heads_per_stage=0"]).heads_per_stage == 32
    assert load_config(None, ["model.preset=llama3-8b", "attention.heads_per_stage=all"]).heads_per_stage == 32


def test_allgather_stages_one_kv_heads_group_by_default_and_needs_no_head_split_over_sp():
    allgather = ["attention.sp_method=allgather"]
    assert load_config(None, ["model.preset=llama3-8b", "mesh.sp=8", *allgather]).heads_per_stage == 4  # 32 / 8 kv
    qwen = load_config(None, ["model.preset=qwen2.5-14b", "mesh.sp=16", "train.seq_len=65536", *allgather])
    assert (qwen.heads_per_stage, qwen.sequence_granule) == (5, 32 * 512)  # 40 heads, 8 kv; 2 x sp chunks of blocks


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.preset=llama3-8b", "train.setps=3"], "unknown config key train.setps (did you mean 'train.steps'?)"),
        (["model.preset=llama3-8b", "trian.steps=3"], "unknown config section 'trian' (did you mean 'train'?)"),
        (["model.preset=llama9"], "unknown model.preset 'llama9'"),
        (["model.preset=llama3-8b", "train.steps=many"], "train.steps must be an integer, got 'many'"),
        (["model.preset=llama3-8b", "train.steps=2.5"], "train.steps must be an integer"),
        (["model.preset=llama3-8b", "model.num_key_value_heads=5"], "must be a multiple of model.num_key_value_heads (5)"),
        (["model.preset=llama3-8b", "attention.impl=flash"], "attention.impl must be one of auto, cudnn, blockwise, reference"),
        (["model.preset=llama3-8b", "data.shuffle=maybe"], "data.shuffle must be true or false"),
        (["model.preset=llama3-8b", "train.steps=0"], "train.steps must be positive"),
        (["model.preset=llama3-8b", "train.batch_size=3", "mesh.fsdp=2"], "must be a multiple of mesh.data x mesh.fsdp"),
        (["model.preset=llama3-8b", "train.seq_len=1001", "mesh.sp=8"], "nearest valid: 1000 or 1008"),
        (["model.preset=llama3-8b", "data.source=tokens"], "data.source=tokens needs data.path"),
        (["mesh.sp=2"], "no 'model' section"),
        (["model.hidden_size=8"], "model.vocab_size is required"),
        (["model.preset=llama3-8b", "novalue"], "must look like section.key=value"),
        (["model.preset=qwen2.5-14b", "mesh.sp=16"], "sp degrees that work: 1, 2, 4, 5, 8, 10, 20, 40"),
        (["model.preset=llama3-8b", "mesh.sp=8", "attention.heads_per_stage=12"], "values that work: 8, 16, 32"),
        (["model.preset=llama3-8b", "attention.sp_method=ring"],
         "attention.sp_method 'ring' is not a sequence-parallel method jlong knows (known: allgather, ulysses)"),
        (["model.preset=llama3-8b", "attention.sp_method=allgather", "mesh.ring=2", "mesh.sp=4"],
         "attention.sp_method=allgather spreads the sequence over mesh.sp alone, but mesh.ring is 2"),
        (["model.preset=llama3-8b", "attention.sp_method=allgather", "attention.heads_per_stage=5"],
         "attention.heads_per_stage (5) must divide the 32 heads (it is the all-gather method's stage size)"),
        (["model.preset=llama3-8b", "attention.sp_method=allgather", "mesh.sp=8", "train.seq_len=1000"],
         "must be a multiple of 2 x mesh.sp (16: the all-gather method's zigzag layout"),
    ],
)
def test_bad_configs_are_one_clear_line(overrides, message):
    with pytest.raises(JlongError) as error:
        load_config(None, overrides)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  preset: llama3-8b\n train: [\n")
    with pytest.raises(JlongError, match="cannot parse .* at line 3"):
        load_config(path)
    with pytest.raises(JlongError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_inline_fields_that_contradict_a_checkpoint_are_refused(tmp_path):
    from hf_models import small_hf_model

    small_hf_model("llama").save_pretrained(tmp_path)
    layers = json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(JlongError, match=f"model.num_hidden_layers=1 contradicts .* num_hidden_layers={layers}"):
        load_config(None, [f"model.hf_path={tmp_path}", "model.num_hidden_layers=1"])
    # The same value, and fields that leave the weights as they are, may be set inline.
    config = load_config(None, [f"model.hf_path={tmp_path}", f"model.num_hidden_layers={layers}",
                                "model.rope_theta=5e6"])
    assert config.model.num_hidden_layers == layers and config.model.rope_theta == 5e6
