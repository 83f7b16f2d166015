"""Llama 3.x and its close relatives Qwen 2.5 and Qwen 3: pre-norm blocks,
x + attention(norm(x)), then + swiglu(norm(x)).

Qwen 2.5 adds biases to the q, k and v projections (its config.json does not
say so: every Qwen2 has them); Qwen 3 normalises q and k per head.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import Family, HFTensor, hf_projection_tensors
from jlong.families.params import ParamSpec, Role, attention_matrices, gated_mlp_matrices
from jlong.ops.shards import HIDDEN

if TYPE_CHECKING:
    from jlong.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class LlamaFamily(Family):
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen 3)
    qkv_bias: bool | None = None  # q/k/v biases: always (Qwen 2), never, or as model.attention_bias says (None)

    def config_defaults(self) -> dict[str, Any]:
        defaults = {"qk_norm": self.qk_norm}
        if self.qkv_bias is not None:
            defaults["attention_bias"] = self.qkv_bias
        return defaults

    def check(self, model: ModelConfig) -> None:
        for key, value in self.config_defaults().items():
            if getattr(model, key) != value:
                raise JlongError(f"model.{key}={str(getattr(model, key)).lower()} is not a {self.name} model "
                                 f"(model.family={self.name} has {key}={str(value).lower()}): drop model.{key} "
                                 "or name the family it belongs to")

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        D, H, K, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dim_per_head
        norm, bias = Role.NORM, Role.BIAS
        specs = {
            "attn_norm": ParamSpec((D,), ("embed",), norm),
            **attention_matrices(model),
            "mlp_norm": ParamSpec((D,), ("embed",), norm),
            **gated_mlp_matrices(model),
        }
        if model.attention_bias:
            specs["bq"] = ParamSpec((H, d), ("heads", "head_dim"), bias)
            specs["bk"] = ParamSpec((K, d), ("kv_heads", "head_dim"), bias)
            specs["bv"] = ParamSpec((K, d), ("kv_heads", "head_dim"), bias)
        if model.qk_norm:
            specs["q_norm"] = ParamSpec((d,), ("head_dim",), norm)
            specs["k_norm"] = ParamSpec((d,), ("head_dim",), norm)
        return specs

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model, options):
        """Pre-norm residual block: x + attention(norm(x)), then the channel mixer."""
        x_BSD = options.shards.constrain(
            blocks.attention(p, x_BSD, positions_BS, segment_ids_BS, model, options), HIDDEN)
        return self.channel_mixer(p, x_BSD, model, options)

    def channel_mixer(self, p, x_BSD, model, options):
        """x + swiglu(norm(x))."""
        return options.shards.constrain(blocks.residual_swiglu(p, x_BSD, model, options), HIDDEN)

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        fields = super().hf_fields(hf, where)
        fields.update(self.config_defaults())
        if self.qkv_bias is None:
            fields["attention_bias"] = bool(hf.get("attention_bias", False))
        return fields

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        hf = {**super().hf_config(model), "hidden_act": "silu"}
        if self.qkv_bias is None:
            hf["attention_bias"] = model.attention_bias
        if self.name != "llama":
            hf["use_sliding_window"] = False
        return hf

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        table = self.hf_tensor_table(model)
        return {name: table[name] for name in self.layer_params(model)}

    def hf_tensor_table(self, model: ModelConfig) -> dict[str, HFTensor]:
        """Every layer parameter's tensor this family's models may have."""
        H, K, d = model.num_attention_heads, model.kv_heads, model.dim_per_head

        def heads(name, n):
            return HFTensor(name, lambda b: b.reshape(n, d), lambda b: b.reshape(n * d))

        return {
            **hf_projection_tensors(model),
            "attn_norm": HFTensor("input_layernorm.weight"),
            "mlp_norm": HFTensor("post_attention_layernorm.weight"),
            "bq": heads("self_attn.q_proj.bias", H),
            "bk": heads("self_attn.k_proj.bias", K),
            "bv": heads("self_attn.v_proj.bias", K),
            "q_norm": HFTensor("self_attn.q_norm.weight"),
            "k_norm": HFTensor("self_attn.k_norm.weight"),
        }


LLAMA = LlamaFamily("llama", "LlamaForCausalLM")
QWEN2 = LlamaFamily("qwen2", "Qwen2ForCausalLM", qkv_bias=True)
QWEN3 = LlamaFamily("qwen3", "Qwen3ForCausalLM", qk_norm=True)
