"""GPT-OSS (`gpt_oss`: OpenAI's gpt-oss-20b and gpt-oss-120b): pre-norm
blocks, x + attention(norm(x)), then + experts(norm(x)), every layer's
channel mixer a mixture of experts.

What differs from Llama, each read from the Hugging Face config:

- `layer_types` alternate "sliding_attention" (a token sees itself and the
  `sliding_window` - 1 tokens before it, 128) and "full_attention", sliding
  first, as in Gemma 3's machinery (`Family.attention_window`);
- attention sinks: a learned logit per query head joins every query's
  softmax denominator (`attn_sinks`, Hugging Face's `self_attn.sinks`;
  `jlong.attention.sinks`), and with `attention_bias` the q, k, v and output
  projections all have biases (`bo`, `self_attn.o_proj.bias`);
- YaRN RoPE (factor 32 over an original 4,096 tokens, `truncate: false`);
- the mixture (`jlong.moe.experts`): a router with a bias picks the top
  `num_experts_per_tok` logits and weighs the chosen experts by a softmax
  over those logits alone; each expert has biases on its projections, its
  gate and up projections are one matrix whose columns alternate gate, up
  (`gate_up_proj`, kept so: `expert_gate_up` [E, D, 2F]), and its activation
  is the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`). The experts are of
  `intermediate_size` (Hugging Face's name; there is no dense MLP).

Checkpoints come in bf16 or as OpenAI publishes them, with the experts'
matrices in MXFP4 (`*_blocks` and `*_scales`, read by `jlong.hf` through
`jlong.moe.mxfp4`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import FULL_ATTENTION, TRANSPOSED, Family, HFTensor, hf_projection_tensors
from jlong.families.moe import hf_expert_fields
from jlong.families.params import INIT_STD, ParamSpec, Role, attention_matrices
from jlong.moe.experts import ClampedSwiGLU, MixtureOfExperts
from jlong.ops.shards import HIDDEN

if TYPE_CHECKING:
    from jlong.config import ModelConfig

SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (SLIDING_ATTENTION, FULL_ATTENTION)
# GptOssConfig's defaults, for the fields a config.json leaves out.
HF_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
           "original_max_position_embeddings": 4096}
HF_DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
    "attention_bias": True,
}
HF_ROPE_THETA = 150000.0
EXPERT_FIELDS = ("num_experts", "num_experts_per_tok")


def _normal(key, shape, dtype):
    """How transformers starts the sinks and the router's bias: normal, std initializer_range."""
    return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class GptOssFamily(Family):
    def config_defaults(self) -> dict[str, Any]:
        return {"attention_bias": True, "sliding_window": HF_DEFAULTS["sliding_window"],
                "swiglu_limit": HF_DEFAULTS["swiglu_limit"], "swiglu_alpha": HF_DEFAULTS["swiglu_alpha"],
                "rope_theta": HF_ROPE_THETA, "rope_scaling": dict(HF_YARN)}

    @property
    def known_layer_types(self) -> tuple[str, ...]:
        return LAYER_TYPES

    def check(self, model: ModelConfig) -> None:
        name = self.name
        if unset := [key for key in EXPERT_FIELDS if getattr(model, key) is None]:
            raise JlongError(f"model.family={name} is a mixture of experts: set model.{', model.'.join(unset)}")
        if model.num_experts_per_tok > model.num_experts:
            raise JlongError(f"model.num_experts_per_tok ({model.num_experts_per_tok}) is more than "
                             f"model.num_experts ({model.num_experts})")
        if model.moe_intermediate_size is not None:
            raise JlongError(f"model.family={name}'s experts are of model.intermediate_size (Hugging Face's name): "
                             "drop model.moe_intermediate_size")
        if model.qk_norm:
            raise JlongError(f"model.family={name} has no q/k norms: drop model.qk_norm")
        if model.norm_topk_prob:
            raise JlongError(f"model.family={name} weighs its experts by a softmax over the chosen logits (they sum "
                             "to one already): drop model.norm_topk_prob")
        for key in ("swiglu_limit", "swiglu_alpha", "sliding_window"):
            if getattr(model, key) is None and (key != "sliding_window" or SLIDING_ATTENTION in self.layer_types(model)):
                raise JlongError(f"model.family={name} needs model.{key} (Hugging Face's default is "
                                 f"{HF_DEFAULTS[key]}): drop model.{key}=null")
        self.check_layer_types(model, "GPT-OSS")

    def attention_sinks(self, model: ModelConfig) -> bool:
        return True  # every layer's (the method and kernel must run them: `Family.check_parallel`)

    # ---------------------------------------------------------------- layout

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        D, H, K, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dim_per_head
        E, F = model.num_experts, model.intermediate_size
        norm, bias, matrix = Role.NORM, Role.BIAS, Role.MATRIX
        specs = {
            "attn_norm": ParamSpec((D,), ("embed",), norm),
            **attention_matrices(model),
            "attn_sinks": ParamSpec((H,), ("heads",), bias, init=_normal),
        }
        if model.attention_bias:
            specs["bq"] = ParamSpec((H, d), ("heads", "head_dim"), bias)
            specs["bk"] = ParamSpec((K, d), ("kv_heads", "head_dim"), bias)
            specs["bv"] = ParamSpec((K, d), ("kv_heads", "head_dim"), bias)
            specs["bo"] = ParamSpec((D,), ("embed",), bias)
        specs.update({
            "mlp_norm": ParamSpec((D,), ("embed",), norm),
            "router": ParamSpec((D, E), ("embed", "experts"), matrix),
            "router_bias": ParamSpec((E,), ("experts",), bias, init=_normal),
            "expert_gate_up": ParamSpec((E, D, 2 * F), ("experts", "embed", "mlp"), matrix),
            "expert_gate_up_bias": ParamSpec((E, 2 * F), ("experts", "mlp"), bias),
            "expert_down": ParamSpec((E, F, D), ("experts", "mlp", "embed"), matrix),
            "expert_down_bias": ParamSpec((E, D), ("experts", "embed"), bias),
        })
        return specs

    # ---------------------------------------------------------------- maths

    def layer_types(self, model: ModelConfig) -> tuple[str, ...]:
        if model.layer_types is not None:
            return tuple(model.layer_types)
        return tuple(SLIDING_ATTENTION if i % 2 == 0 else FULL_ATTENTION for i in range(model.num_hidden_layers))

    def attention_window(self, model: ModelConfig, layer_type: str) -> int:
        return model.sliding_window if layer_type == SLIDING_ATTENTION else 0

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model, options):
        """x + attention(norm(x)) with sinks and Wo's bias, then x + experts(norm(x)) and the routing statistics."""
        constrain = options.shards.constrain
        x_BSD = constrain(blocks.attention(p, x_BSD, positions_BS, segment_ids_BS, model, options,
                                           projection=_projection(model, options.mlp_tile)), HIDDEN)
        x_BSD, statistics = blocks.residual_experts(p, x_BSD, model, mixture_of(model), options)
        return constrain(x_BSD, HIDDEN), statistics

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        hf = {**HF_DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}
        if hf.get("experts_per_token") is not None and "num_experts_per_tok" not in hf:
            hf["num_experts_per_tok"] = hf["experts_per_token"]
        rope = hf.get("rope_parameters") or {}
        if "rope_theta" not in hf and "rope_theta" not in rope:
            hf["rope_theta"] = HF_ROPE_THETA
        if not set(rope) - {"rope_theta"} and not hf.get("rope_scaling"):
            hf["rope_scaling"] = dict(HF_YARN)
        fields = {**super().hf_fields(hf, where), **hf_expert_fields(hf)}
        fields.pop("moe_intermediate_size", None)
        fields.update(
            attention_bias=bool(hf["attention_bias"]), sliding_window=int(hf["sliding_window"]),
            swiglu_limit=float(hf["swiglu_limit"]), swiglu_alpha=float(hf["swiglu_alpha"]),
            layer_types=tuple(hf["layer_types"]) if hf.get("layer_types") else None,
        )
        return fields

    def hf_left_out(self, hf: dict[str, Any]) -> list[str]:
        quantization = hf.get("quantization_config") or {}
        if quantization.get("quant_method") == "mxfp4":
            return ["the experts' MXFP4 quantization (they are read dequantized, in train.param_dtype)"]
        return []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        hf = super().hf_config(model)
        hf.update(
            num_local_experts=model.num_experts, num_experts_per_tok=model.num_experts_per_tok,
            router_aux_loss_coef=model.router_aux_loss_coef, output_router_logits=model.output_router_logits,
            attention_bias=model.attention_bias, sliding_window=model.sliding_window,
            layer_types=list(self.layer_types(model)), swiglu_limit=model.swiglu_limit,
            swiglu_alpha=model.swiglu_alpha, hidden_act="silu",
        )
        return hf

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        H, K, d = model.num_attention_heads, model.kv_heads, model.dim_per_head

        def heads(name, n):
            return HFTensor(name, lambda b: b.reshape(n, d), lambda b: b.reshape(n * d))

        tensors = {
            **{name: t for name, t in hf_projection_tensors(model).items() if name in ("wq", "wk", "wv", "wo")},
            "attn_norm": HFTensor("input_layernorm.weight"),
            "attn_sinks": HFTensor("self_attn.sinks"),
            "bq": heads("self_attn.q_proj.bias", H),
            "bk": heads("self_attn.k_proj.bias", K),
            "bv": heads("self_attn.v_proj.bias", K),
            "bo": HFTensor("self_attn.o_proj.bias"),
            "mlp_norm": HFTensor("post_attention_layernorm.weight"),
            # the router is a linear layer, [E, D]; the experts are [E, in, out] as jlong keeps them
            "router": HFTensor("mlp.router.weight", **TRANSPOSED),
            "router_bias": HFTensor("mlp.router.bias"),
            "expert_gate_up": HFTensor("mlp.experts.gate_up_proj"),
            "expert_gate_up_bias": HFTensor("mlp.experts.gate_up_proj_bias"),
            "expert_down": HFTensor("mlp.experts.down_proj"),
            "expert_down_bias": HFTensor("mlp.experts.down_proj_bias"),
        }
        return {name: tensors[name] for name in self.layer_params(model)}


def mixture_of(model: ModelConfig) -> MixtureOfExperts:
    """GPT-OSS's experts as `MixtureOfExperts` options."""
    return MixtureOfExperts(
        model.num_experts, model.num_experts_per_tok, normalize=False, router_bias=True, softmax_after_top_k=True,
        fused_gate_up=True, expert_bias=True, activation=ClampedSwiGLU(model.swiglu_limit, model.swiglu_alpha),
    )


@functools.lru_cache(maxsize=64)
def _projection(model: ModelConfig, tile: int):
    """The model's q, k, v projection with its sinks and, with attention_bias, Wo's bias."""
    return dataclasses.replace(blocks.projection_of(model, tile), sinks=True, output_bias=model.attention_bias)


GPT_OSS = GptOssFamily("gpt_oss", "GptOssForCausalLM")
