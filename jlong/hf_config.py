"""Hugging Face config.json <-> jlong `model` fields, without jax.

Reads both config forms: transformers 4 (`rope_theta`, `rope_scaling`) and
transformers 5 (`rope_parameters`). Writes the transformers 4 form, which
both generations load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jlong.errors import JlongError

if TYPE_CHECKING:
    from jlong.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The jlong `model` fields that a Hugging Face config.json describes."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise JlongError(f"Hugging Face checkpoint {str(path)!r} has no config.json")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise JlongError(f"cannot parse {config_path}: {err.msg} at line {err.lineno}") from None
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise JlongError(
            f"{config_path}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if hf.get("mlp_bias"):
        raise JlongError(f"{config_path}: mlp_bias=true is not supported")
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or rope or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" \
            and scaling.get("original_max_position_embeddings") is None:  # as transformers reads it
        original = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
        scaling = {**scaling, "original_max_position_embeddings": original}
    fields = {
        key: hf[key]
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings",
        )
        if hf.get(key) is not None
    }
    fields.update(
        rope_theta=float(theta),
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in attention_bias.
        attention_bias=True if model_type == "qwen2" else bool(hf.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
    )
    return fields


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    architecture = config.hf_architecture
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
    hf = {
        "architectures": [architecture],
        "model_type": model_type[architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.dim_per_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings or 131072,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }
    if architecture != "Qwen2ForCausalLM":
        hf["attention_bias"] = config.attention_bias
    if architecture != "LlamaForCausalLM":
        hf["use_sliding_window"] = False
    return hf
