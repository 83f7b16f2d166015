"""Gemma 3 (the text model, `gemma3_text`): sliding-window and global layers.

What differs from Llama, each read from the Hugging Face config:

- `layer_types` names each layer "sliding_attention" (a token sees itself
  and the `sliding_window` - 1 tokens before it) or "full_attention"; when a
  config has none, every `sliding_window_pattern`-th layer (6th) is global;
- RoPE per layer type: the global layers' base (`rope_theta`, with
  `rope_scaling`, linear in 4B and larger) and the sliding layers' own
  (`rope_local_base_freq`, unscaled);
- queries scaled by `query_pre_attn_scalar`^-1/2, not head_dim^-1/2;
- RMSNorm as x * (1 + w) (the weights kept as Hugging Face keeps them, as
  offsets from one), per-head q and k norms, norms before and after both
  attention and the MLP;
- the MLP is GeGLU with GELU's tanh approximation;
- embeddings scaled by sqrt(hidden_size), tied to the output by default.

Logit soft-capping (Gemma 2's) is absent in Gemma 3; a config that sets it is
refused, as is bidirectional attention.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import (FULL_ATTENTION, SHARED_HF_KEYS, HFTensor, OffsetNormFamily, every_nth_layer,
                                 hf_projection_tensors)
from jlong.families.params import ParamSpec, Role, attention_matrices, gated_mlp_matrices
from jlong.ops.layers import geglu, rms_norm
from jlong.ops.shards import HIDDEN
from jlong.ops.tiling import per_sequence_tile

if TYPE_CHECKING:
    from jlong.config import ModelConfig

SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)
# Gemma3TextConfig's defaults, for the fields a config.json leaves out.
HF_DEFAULTS = {"head_dim": 256, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}
OFFSET_NORMS = ("attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")
MLP_PARAMS = ("mlp_norm", "w_gate", "w_up", "w_down", "post_mlp_norm")
REFUSED = {
    "final_logit_softcapping": "logit soft-capping",
    "attn_logit_softcapping": "attention logit soft-capping",
    "use_bidirectional_attention": "bidirectional attention",
}


@dataclasses.dataclass(frozen=True)
class Gemma3Family(OffsetNormFamily):
    def config_defaults(self) -> dict[str, Any]:
        return {"qk_norm": True, "tie_word_embeddings": True, "rms_norm_eps": 1e-6,
                "sliding_window": HF_DEFAULTS["sliding_window"]}

    @property
    def known_layer_types(self) -> tuple[str, ...]:
        return LAYER_TYPES

    def check(self, model: ModelConfig) -> None:
        if not model.qk_norm or model.attention_bias:
            raise JlongError(f"model.family={self.name} has q/k norms and no attention biases: drop model.qk_norm "
                             "and model.attention_bias")
        self.check_layer_types(model, "Gemma 3")

    # ---------------------------------------------------------------- layout

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        D, d, norm = model.hidden_size, model.dim_per_head, Role.NORM_OFFSET
        return {
            "attn_norm": ParamSpec((D,), ("embed",), norm),
            **attention_matrices(model),
            "q_norm": ParamSpec((d,), ("head_dim",), norm),
            "k_norm": ParamSpec((d,), ("head_dim",), norm),
            "post_attn_norm": ParamSpec((D,), ("embed",), norm),
            "mlp_norm": ParamSpec((D,), ("embed",), norm),
            **gated_mlp_matrices(model),
            "post_mlp_norm": ParamSpec((D,), ("embed",), norm),
        }

    # ---------------------------------------------------------------- maths

    def layer_types(self, model: ModelConfig) -> tuple[str, ...]:
        if model.layer_types is not None:
            return tuple(model.layer_types)
        every = model.sliding_window_pattern or HF_DEFAULTS["sliding_window_pattern"]
        return every_nth_layer(model, every, FULL_ATTENTION, SLIDING_ATTENTION)

    def attention_window(self, model: ModelConfig, layer_type: str) -> int:
        return model.sliding_window if layer_type == SLIDING_ATTENTION else 0

    def scale_embeddings(self, x_BSD, model: ModelConfig):
        return x_BSD * jnp.asarray(math.sqrt(model.hidden_size), x_BSD.dtype)

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model, options):
        """x + norm(attention(norm(x))), then + norm(geglu(norm(x))); the
        attention's stages add into a buffer of their own (the norm after it
        applies to their sum)."""
        constrain, eps = options.shards.constrain, model.rms_norm_eps
        p = {name: blocks.offset_scale(w) if name in OFFSET_NORMS else w for name, w in p.items()}
        projection = _projection(model, options.layer_type, options.mlp_tile)
        a_BSD = blocks.attention(p, x_BSD, positions_BS, segment_ids_BS, model, options, add_to_input=False,
                                 projection=projection)
        x_BSD = constrain(x_BSD + rms_norm(a_BSD, p["post_attn_norm"], eps), HIDDEN)
        mlp = functools.partial(_residual_geglu, eps=eps)
        x_BSD = per_sequence_tile(mlp, {n: p[n] for n in MLP_PARAMS}, x_BSD, shards=options.shards,
                                  tile=options.mlp_tile)
        return constrain(x_BSD, HIDDEN)

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        for key, what in REFUSED.items():
            if hf.get(key):
                raise JlongError(f"{where}: {key}={hf[key]} is not supported ({what} is not part of Gemma 3)")
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise JlongError(f"{where}: hidden_activation={activation} is not supported (Gemma 3's is "
                             "gelu_pytorch_tanh)")
        hf = {**HF_DEFAULTS, "tie_word_embeddings": True, **{k: v for k, v in hf.items() if v is not None}}
        fields = {key: hf[key] for key in SHARED_HF_KEYS if key in hf}
        full, local = _rope_by_layer_type(hf, where)
        fields.update(
            family=self.name, qk_norm=True, tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            rope_theta=float(full.pop("rope_theta")), rope_scaling=full or None,
            rope_local_base_freq=float(local["rope_theta"]), sliding_window=int(hf["sliding_window"]),
            query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
        )
        if hf.get("layer_types"):
            fields["layer_types"] = tuple(hf["layer_types"])
        else:
            fields["sliding_window_pattern"] = int(hf["sliding_window_pattern"])
        return fields

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        hf = super().hf_config(model)
        hf.update(
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=_query_pre_attn_scalar(model),
            sliding_window=model.sliding_window, layer_types=list(self.layer_types(model)),
            rope_local_base_freq=_local_base(model), final_logit_softcapping=None, attn_logit_softcapping=None,
            attention_bias=False,
        )
        return hf

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        return {
            **hf_projection_tensors(model),
            "attn_norm": HFTensor("input_layernorm.weight"),
            "q_norm": HFTensor("self_attn.q_norm.weight"),
            "k_norm": HFTensor("self_attn.k_norm.weight"),
            "post_attn_norm": HFTensor("post_attention_layernorm.weight"),
            "mlp_norm": HFTensor("pre_feedforward_layernorm.weight"),
            "post_mlp_norm": HFTensor("post_feedforward_layernorm.weight"),
        }


def _query_pre_attn_scalar(model: ModelConfig) -> float:
    scalar = model.query_pre_attn_scalar or model.dim_per_head
    return int(scalar) if float(scalar).is_integer() else scalar  # transformers 5 types it int


def _local_base(model: ModelConfig) -> float:
    return model.rope_local_base_freq or HF_DEFAULTS["rope_local_base_freq"]


@functools.lru_cache(maxsize=64)
def _projection(model: ModelConfig, layer_type: str, tile: int):
    """The q, k, v projection of a layer type: its RoPE (the sliding layers'
    own base, unscaled) and the query scale that makes the kernels'
    head_dim^-1/2 into query_pre_attn_scalar^-1/2."""
    rope_model = model
    if layer_type == SLIDING_ATTENTION:
        rope_model = model.model_copy(update={"rope_theta": _local_base(model), "rope_scaling": None})
    query_scale = math.sqrt(model.dim_per_head / _query_pre_attn_scalar(model))
    return dataclasses.replace(blocks.projection_of(rope_model, tile), query_scale=query_scale)


def _rope_by_layer_type(hf: dict[str, Any], where: str) -> tuple[dict, dict]:
    """(the global layers' RoPE: rope_theta and any scaling fields, the
    sliding layers'), from either config form: transformers 5's
    `rope_parameters` keyed by layer type, or transformers 4's `rope_theta`,
    `rope_scaling` and `rope_local_base_freq`."""
    by_type = hf.get("rope_parameters")
    if by_type and set(by_type) <= set(LAYER_TYPES):
        full = dict(by_type.get(FULL_ATTENTION) or {})
        local = dict(by_type.get(SLIDING_ATTENTION) or {})
        full.setdefault("rope_theta", hf["rope_theta"])
        local.setdefault("rope_theta", hf["rope_local_base_freq"])
    else:
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf["rope_theta"]}
        local = {"rope_theta": hf["rope_local_base_freq"]}
    for kind, rope in ((FULL_ATTENTION, full), (SLIDING_ATTENTION, local)):
        if rope.get("rope_type", rope.get("type", "default")) == "default":
            rope.pop("rope_type", None), rope.pop("type", None)
        elif kind == SLIDING_ATTENTION:
            raise JlongError(f"{where}: RoPE scaling of the sliding layers is not supported")
    return full, local


def _residual_geglu(p, x_BSD, *, eps):
    h_BSD = geglu(rms_norm(x_BSD, p["mlp_norm"], eps), p["w_gate"], p["w_up"], p["w_down"])
    return x_BSD + rms_norm(h_BSD, p["post_mlp_norm"], eps)


GEMMA3_TEXT = Gemma3Family("gemma3_text", "Gemma3ForCausalLM")
