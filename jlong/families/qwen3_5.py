"""Qwen3.5 (the text model, `qwen3_5_text`): Gated DeltaNet layers with a
gated full-attention layer every fourth.

Each layer is a token mixer and the SwiGLU MLP, pre-norm and residual as in
Llama; its type (Hugging Face's `layer_types`; when a config has none, every
`full_attention_interval`-th layer is "full_attention", the rest
"linear_attention") chooses the token mixer:

- "linear_attention": Gated DeltaNet (`jlong.linear_attention.gated_deltanet`),
  run by the sequence-parallel method's `linear_attention`;
- "full_attention": attention with per-head q/k norms, RoPE on the first
  `partial_rotary_factor` of each head's dimensions, and an output gate:
  q_proj makes each head's query and a gate, and the heads' output is
  multiplied by sigmoid(gate) before o_proj.

Norms are kept as Hugging Face keeps them, as offsets from one (x * (1 + w)),
except Gated DeltaNet's per-head output norm, a plain weight. Each layer type
has its own parameters (stacked over its layers alone); the norms and the
MLP every layer has. RoPE's multimodal sections (`mrope_section`) give text
tokens the same positions in every section, so text runs plain RoPE.
Published checkpoints also hold multi-token-prediction layers (`mtp.*`):
jlong reads the language model and leaves them out.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import (FULL_ATTENTION, TRANSPOSED, HFTensor, OffsetNormFamily, every_nth_layer,
                                 hf_projection_tensors)
from jlong.families.params import ParamSpec, Role, gated_mlp_matrices
from jlong.linear_attention.gated_deltanet import (LINEAR_ATTENTION, GatedDeltaNet, conv_flops_per_token,
                                                   rule_flops_per_token)
from jlong.linear_attention.gated_delta import CHUNK
from jlong.ops.shards import HIDDEN

if TYPE_CHECKING:
    from jlong.attention.methods import SequenceParallelMethod
    from jlong.config import Config, ModelConfig

LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)
# Qwen3_5TextConfig's defaults, for the fields a config.json leaves out.
HF_DEFAULTS = {
    "head_dim": 256, "rms_norm_eps": 1e-6, "full_attention_interval": 4, "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
OFFSET_NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")
ROPE_EXTRAS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")  # rope_parameters' non-RoPE keys


def _decay_rates(key, shape, dtype):
    """A_log: the log of rates drawn uniformly from [1, 16], as Hugging Face initialises them."""
    return jnp.log(jax.random.uniform(key, shape, jnp.float32, 1.0, 16.0)).astype(dtype)


def _ones(key, shape, dtype):
    return jnp.ones(shape, dtype)


@dataclasses.dataclass(frozen=True)
class Qwen3_5Family(OffsetNormFamily):
    @property
    def known_layer_types(self) -> tuple[str, ...]:
        return LAYER_TYPES

    def config_defaults(self) -> dict[str, Any]:
        return {"qk_norm": True, **HF_DEFAULTS}

    def check(self, model: ModelConfig) -> None:
        if not model.qk_norm or model.attention_bias:
            raise JlongError(f"model.family={self.name} has q/k norms and no attention biases: drop model.qk_norm "
                             "and model.attention_bias")
        self.check_layer_types(model, "Qwen3.5")
        if model.linear_num_value_heads % model.linear_num_key_heads:
            raise JlongError(f"model.linear_num_value_heads ({model.linear_num_value_heads}) must be a multiple of "
                             f"model.linear_num_key_heads ({model.linear_num_key_heads})")

    def check_parallel(self, config: Config, method: SequenceParallelMethod) -> None:
        super().check_parallel(config, method)
        if LINEAR_ATTENTION in self.layer_types(config.model):
            method.check_linear_attention(config, self.linear_layer(config.model))

    def linear_layer(self, model: ModelConfig) -> GatedDeltaNet:
        """The Gated DeltaNet of the "linear_attention" layers."""
        return GatedDeltaNet(model.linear_num_key_heads, model.linear_num_value_heads, model.linear_key_head_dim,
                             model.linear_value_head_dim, model.rms_norm_eps)

    # ---------------------------------------------------------------- layout

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        D, H, K, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dim_per_head
        gdn = self.linear_layer(model)
        Hv, dv, taps = gdn.value_heads, gdn.value_dim, model.linear_conv_kernel_dim
        norm, matrix = Role.NORM_OFFSET, Role.MATRIX
        full = functools.partial(ParamSpec, layer_type=FULL_ATTENTION)
        linear = functools.partial(ParamSpec, layer_type=LINEAR_ATTENTION)
        return {
            "attn_norm": ParamSpec((D,), ("embed",), norm),
            "wq": full((D, H, 2 * d), ("embed", "heads", "head_dim"), matrix),  # each head's query, then its gate
            "wk": full((D, K, d), ("embed", "kv_heads", "head_dim"), matrix),
            "wv": full((D, K, d), ("embed", "kv_heads", "head_dim"), matrix),
            "wo": full((H, d, D), ("heads", "head_dim", "embed"), matrix),
            "q_norm": full((d,), ("head_dim",), norm),
            "k_norm": full((d,), ("head_dim",), norm),
            "gdn_qkv": linear((D, gdn.channels), ("embed", "conv_channels"), matrix),
            "gdn_conv": linear((taps, gdn.channels), ("conv_taps", "conv_channels"), Role.CONV),
            "gdn_z": linear((D, Hv, dv), ("embed", "heads", "head_dim"), matrix),
            "gdn_b": linear((D, Hv), ("embed", "heads"), matrix),
            "gdn_a": linear((D, Hv), ("embed", "heads"), matrix),
            "gdn_a_log": linear((Hv,), ("heads",), Role.BIAS, init=_decay_rates),
            "gdn_dt_bias": linear((Hv,), ("heads",), Role.BIAS, init=_ones),
            "gdn_norm": linear((dv,), ("head_dim",), Role.NORM),
            "gdn_out": linear((Hv, dv, D), ("heads", "head_dim", "embed"), matrix),
            "mlp_norm": ParamSpec((D,), ("embed",), norm),
            **gated_mlp_matrices(model),
        }

    # ---------------------------------------------------------------- maths

    def layer_types(self, model: ModelConfig) -> tuple[str, ...]:
        if model.layer_types is not None:
            return tuple(model.layer_types)
        every = model.full_attention_interval or HF_DEFAULTS["full_attention_interval"]
        return every_nth_layer(model, every, FULL_ATTENTION, LINEAR_ATTENTION)

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model, options):
        """x + token mixer(norm(x)), the mixer the layer type's, then the channel mixer."""
        p = {name: blocks.offset_scale(w) if name in OFFSET_NORMS else w for name, w in p.items()}
        if options.layer_type == LINEAR_ATTENTION:
            layer = dataclasses.replace(self.linear_layer(model), kernel=options.gated_delta,
                                        interpret=options.interpret_kernels)
            x_BSD = options.sequence_parallel.linear_attention(p, x_BSD, segment_ids_BS, layer=layer,
                                                               shards=options.shards, tile=options.mlp_tile,
                                                               stages=options.head_stages)
        else:
            x_BSD = blocks.attention(p, x_BSD, positions_BS, segment_ids_BS, model, options,
                                     projection=_projection(model, options.mlp_tile))
        return self.channel_mixer(p, options.shards.constrain(x_BSD, HIDDEN), model, options)

    def channel_mixer(self, p, x_BSD, model, options):
        """x + swiglu(norm(x))."""
        return options.shards.constrain(blocks.residual_swiglu(p, x_BSD, model, options), HIDDEN)

    def flops_per_token(self, model: ModelConfig, seq_len: int) -> float:
        """As `Family.flops_per_token`; the linear-attention layers add the
        chunked rule's work (linear in the length: `rule_flops_per_token`, x3
        with the backward pass) and the convolution's, the full-attention
        layers attention's."""
        gdn = self.linear_layer(model)
        per_linear_layer = 3 * (rule_flops_per_token(gdn.value_heads, gdn.key_dim, gdn.value_dim, CHUNK)
                                + conv_flops_per_token(gdn.channels, model.linear_conv_kernel_dim))
        attention = 12 * model.num_attention_heads * model.dim_per_head * seq_len / 2
        return 6 * self.matmul_params_per_token(model) + sum(
            attention if kind == FULL_ATTENTION else per_linear_layer for kind in self.layer_types(model))

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("attention_bias"):
            raise JlongError(f"{where}: attention_bias=true is not supported (Qwen3.5 has no attention biases)")
        if hf.get("attn_output_gate") is False:
            raise JlongError(f"{where}: attn_output_gate=false is not supported (every Qwen3.5 attention layer is gated)")
        if (activation := hf.get("hidden_act", "silu")) != "silu":
            raise JlongError(f"{where}: hidden_act={activation} is not supported (Qwen3.5's is silu)")
        rope = dict(hf.get("rope_parameters") or {})
        extras = {key: rope.pop(key) for key in ROPE_EXTRAS if key in rope}
        hf = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}, "rope_parameters": rope or None}
        fields = super().hf_fields(hf, where)
        fields.update({key: hf[key] for key in LINEAR_FIELDS}, qk_norm=True, attention_bias=False,
                      partial_rotary_factor=float(extras.get("partial_rotary_factor", hf["partial_rotary_factor"])))
        if hf.get("layer_types"):
            fields["layer_types"] = tuple(hf["layer_types"])
        else:
            fields["full_attention_interval"] = int(hf["full_attention_interval"])
        return fields

    def hf_left_out(self, hf: dict[str, Any]) -> list[str]:
        layers = hf.get("mtp_num_hidden_layers")
        return [f"its {layers} multi-token-prediction layer(s) (mtp.*)"] if layers else []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        hf = super().hf_config(model)
        rope = {"rope_type": "default", **(model.rope_scaling or {}), "rope_theta": hf.pop("rope_theta"),
                "partial_rotary_factor": model.partial_rotary_factor}
        hf.pop("rope_scaling")
        hf.update({key: getattr(model, key) for key in LINEAR_FIELDS}, rope_parameters=rope, hidden_act="silu",
                  layer_types=list(self.layer_types(model)), attention_bias=False)
        return hf

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        D, H, d = model.hidden_size, model.num_attention_heads, model.dim_per_head
        gdn = self.linear_layer(model)
        Hv, dv = gdn.value_heads, gdn.value_dim
        return {
            **{name: t for name, t in hf_projection_tensors(model).items() if name in ("wk", "wv", "wo")},
            "wq": HFTensor("self_attn.q_proj.weight", lambda w: w.T.reshape(D, H, 2 * d),
                           lambda w: w.reshape(D, H * 2 * d).T),
            "attn_norm": HFTensor("input_layernorm.weight"),
            "q_norm": HFTensor("self_attn.q_norm.weight"),
            "k_norm": HFTensor("self_attn.k_norm.weight"),
            "gdn_qkv": HFTensor("linear_attn.in_proj_qkv.weight", **TRANSPOSED),
            "gdn_conv": HFTensor("linear_attn.conv1d.weight", lambda w: w[:, 0, :].T, lambda w: w.T[:, None, :]),
            "gdn_z": HFTensor("linear_attn.in_proj_z.weight", lambda w: w.T.reshape(D, Hv, dv),
                              lambda w: w.reshape(D, Hv * dv).T),
            "gdn_b": HFTensor("linear_attn.in_proj_b.weight", **TRANSPOSED),
            "gdn_a": HFTensor("linear_attn.in_proj_a.weight", **TRANSPOSED),
            "gdn_a_log": HFTensor("linear_attn.A_log"),
            "gdn_dt_bias": HFTensor("linear_attn.dt_bias"),
            "gdn_norm": HFTensor("linear_attn.norm.weight"),
            "gdn_out": HFTensor("linear_attn.out_proj.weight", lambda w: w.T.reshape(Hv, dv, D),
                                lambda w: w.reshape(Hv * dv, D).T),
            "mlp_norm": HFTensor("post_attention_layernorm.weight"),
            **{name: t for name, t in hf_projection_tensors(model).items() if name.startswith("w_")},
        }


@functools.lru_cache(maxsize=64)
def _projection(model: ModelConfig, tile: int):
    """Full attention's q, k, v projection: the model's, with the output gate."""
    return dataclasses.replace(blocks.projection_of(model, tile), output_gate=True)


QWEN3_5_TEXT = Qwen3_5Family("qwen3_5_text", "Qwen3_5ForCausalLM")
