"""DeepSeek-V2 and V3 (`deepseek_v2`: DeepSeek-V2-Lite; `deepseek_v3`:
DeepSeek-V3, Moonlight) and GLM-4.7-Flash (`glm4_moe_lite`): pre-norm
blocks, x + latent attention(norm(x)), then + MLP(norm(x)), as transformers
computes them.

- Attention is multi-head latent attention (`jlong.attention.latent`):
  queries directly or through a compressed query (`q_lora_rank`), keys and
  values from one compressed latent (`kv_lora_rank`) and one rotary key all
  heads share (`qk_rope_head_dim`), values of their own size (`v_head_dim`);
  YaRN's softmax-scale correction (mscale_all_dim) besides its attention
  factor. The checkpoints keep each rotary part in interleaved pairs; jlong
  keeps it in halves (`apply_rope`), reordering the q and kv_a projections'
  rotary columns as it reads and writes them. A checkpoint in halves
  (`rope_interleave: false`) is refused.
- The first layers are dense (`first_k_dense_replace`; GLM lists each
  layer's MLP in `mlp_layer_types`), an MLP of `intermediate_size`; the rest
  mixtures of `n_routed_experts` SwiGLU experts of `moe_intermediate_size`
  and `n_shared_experts` shared ones (one ungated SwiGLU every token runs).
  Routing (`jlong.moe.group_routing`): V3 and GLM score by a sigmoid, choose
  by the scores plus `e_score_correction_bias` within the best `topk_group`
  of `n_group` groups (a group's score: its two best), weigh by the scores
  (renormalised with `norm_topk_prob`) times `routed_scaling_factor`; V2
  scores by a softmax and chooses greedily or within groups (a group's
  score: its best), never renormalising (transformers' V2 ignores
  `norm_topk_prob`, so jlong refuses it).

A checkpoint whose routing transformers would run otherwise than it was
trained (another `scoring_func` or `topk_method`) is refused in one line, as
is a rotary layout the family does not read. The multi-token-prediction
layers (`num_nextn_predict_layers`) are left out without a word, as
transformers leaves them (its configs name one whether or not the checkpoint
holds it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from jlong.attention.latent import LATENT_PARAMS, LatentProjection
from jlong.attention.methods import SequenceParallelMethod
from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import TRANSPOSED, Family, HFTensor, mean_visible_keys
from jlong.families.moe import check_experts, hf_expert_tensors
from jlong.families.params import ParamSpec, Role, expert_matrices, gated_mlp_matrices
from jlong.families.qwen3_moe import DENSE_LAYER, MOE_LAYER
from jlong.moe.experts import CORRECTION_BIAS, MixtureOfExperts
from jlong.moe.group_routing import BEST, SIGMOID, SOFTMAX, TWO_BEST, GroupLimitedRouting
from jlong.ops.layers import rope_attention_factor, rope_inverse_frequencies, rope_type
from jlong.ops.shards import HIDDEN

if TYPE_CHECKING:
    from jlong.config import ModelConfig

GREEDY, GROUP_LIMITED_GREEDY, NOAUX_TC = "greedy", "group_limited_greedy", "noaux_tc"
HF_SPARSE = "sparse"  # GLM's mlp_layer_types name for a mixture layer
LATENT_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
ROUTING_FIELDS = ("num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor",
                  "n_group", "topk_group", "norm_topk_prob", "output_router_logits")
SHARED_EXPERTS = {"shared_gate": "gate_proj", "shared_up": "up_proj", "shared_down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class Version:
    """What differs between the families: routing, which config.json keys say
    which layers are dense, and transformers' defaults for keys a config.json
    leaves out."""

    scoring: str  # SIGMOID (V3, GLM) or SOFTMAX (V2)
    topk_methods: tuple[str, ...]  # the config.json `topk_method`s it runs
    hf_defaults: dict
    mlp_layer_types: bool = False  # GLM: config.json lists each layer's MLP


V2 = Version(SOFTMAX, (GREEDY, GROUP_LIMITED_GREEDY), {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 64, "moe_intermediate_size": 1407, "n_shared_experts": 2, "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 0, "topk_method": GREEDY, "norm_topk_prob": False})
V3 = Version(SIGMOID, (NOAUX_TC,), {
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "norm_topk_prob": True})
GLM = Version(SIGMOID, (NOAUX_TC,), {
    "q_lora_rank": 768, "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
    "n_routed_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 1536, "n_shared_experts": 1,
    "routed_scaling_factor": 1.8, "n_group": 1, "topk_group": 1, "norm_topk_prob": True}, mlp_layer_types=True)


@dataclasses.dataclass(frozen=True)
class DeepseekFamily(Family):
    version: Version = V3

    def config_defaults(self) -> dict[str, Any]:
        defaults = {"topk_method": self.version.topk_methods[0], "n_group": 1, "topk_group": 1,
                    "routed_scaling_factor": 1.0}
        if not self.version.mlp_layer_types:
            defaults["first_k_dense_replace"] = self.version.hf_defaults["first_k_dense_replace"]
        return defaults

    @property
    def known_layer_types(self) -> tuple[str, ...]:
        return (DENSE_LAYER, MOE_LAYER)

    def check(self, model: ModelConfig) -> None:
        name = self.name
        if unset := [key for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                     "n_shared_experts") if getattr(model, key) is None]:
            raise JlongError(f"model.family={name} has latent attention and shared experts: set "
                             f"model.{', model.'.join(unset)}")
        check_experts(model, name)
        qk = model.qk_nope_head_dim + model.qk_rope_head_dim
        if model.head_dim != qk:
            raise JlongError(f"model.head_dim ({model.head_dim}) must be qk_nope_head_dim + qk_rope_head_dim ({qk}): "
                             f"the query and key heads' size in model.family={name}")
        if model.kv_heads != model.num_attention_heads:
            raise JlongError(f"model.num_key_value_heads ({model.kv_heads}) must be model.num_attention_heads "
                             f"({model.num_attention_heads}): latent attention makes keys and values for every head")
        if model.qk_rope_head_dim % 2:
            raise JlongError(f"model.qk_rope_head_dim must be even for rotary embeddings, got {model.qk_rope_head_dim}")
        for key in ("attention_bias", "qk_norm"):
            if getattr(model, key):
                raise JlongError(f"model.{key}=true is not implemented for model.family={name}: drop it")
        if model.partial_rotary_factor not in (None, 1.0):
            raise JlongError(f"model.partial_rotary_factor ({model.partial_rotary_factor}): model.family={name} "
                             "rotates all of qk_rope_head_dim: drop it")
        self._check_routing(model)
        self.check_layer_types(model, name)
        kinds = self.layer_types(model)
        if not self.version.mlp_layer_types and kinds != tuple(sorted(kinds, key=(DENSE_LAYER, MOE_LAYER).index)):
            raise JlongError(f"model.layer_types: model.family={name} has its dense layers first "
                             "(first_k_dense_replace): set that instead")

    def _check_routing(self, model: ModelConfig) -> None:
        name, methods = self.name, self.version.topk_methods
        if model.topk_method not in methods:
            raise JlongError(f"model.topk_method {model.topk_method!r} is not model.family={name}'s routing "
                             f"({' or '.join(methods)})")
        if self.version.scoring == SOFTMAX and model.norm_topk_prob:
            raise JlongError(f"model.norm_topk_prob=true: transformers' {name} never renormalises its top-k weights: "
                             "drop it")
        E, groups, top = model.num_experts, model.n_group, model.topk_group
        if E % groups or top > groups:
            raise JlongError(f"model.n_group ({groups}) must divide model.num_experts ({E}) and be at least "
                             f"model.topk_group ({top})")
        if self._grouped(model) and E // groups * top < model.num_experts_per_tok:
            raise JlongError(f"model.topk_group ({top}) groups of {E // groups} experts hold fewer than "
                             f"model.num_experts_per_tok ({model.num_experts_per_tok})")

    def _grouped(self, model: ModelConfig) -> bool:
        """Whether routing is limited to the best groups (V2's greedy routing never is)."""
        return model.topk_group < model.n_group and model.topk_method != GREEDY

    # ---------------------------------------------------------------- layout

    def layer_types(self, model: ModelConfig) -> tuple[str, ...]:
        if model.layer_types is not None:
            return tuple(model.layer_types)
        dense = model.first_k_dense_replace if model.first_k_dense_replace is not None else 1
        return tuple(DENSE_LAYER if i < dense else MOE_LAYER for i in range(model.num_hidden_layers))

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        D, H = model.hidden_size, model.num_attention_heads
        dq, dn, dv = model.dim_per_head, model.qk_nope_head_dim, model.v_head_dim
        Rq, Rkv = model.q_lora_rank, model.kv_lora_rank
        norm, matrix = Role.NORM, Role.MATRIX
        specs = {"attn_norm": ParamSpec((D,), ("embed",), norm)}
        if Rq:
            specs.update(wq_a=ParamSpec((D, Rq), ("embed", "latent"), matrix),
                         q_a_norm=ParamSpec((Rq,), ("latent",), norm),
                         wq_b=ParamSpec((Rq, H, dq), ("latent", "heads", "head_dim"), matrix))
        else:
            specs["wq"] = ParamSpec((D, H, dq), ("embed", "heads", "head_dim"), matrix)
        specs.update(
            wkv_a=ParamSpec((D, Rkv + model.qk_rope_head_dim), ("embed", "latent"), matrix),
            kv_a_norm=ParamSpec((Rkv,), ("latent",), norm),
            wkv_b=ParamSpec((Rkv, H, dn + dv), ("latent", "heads", "head_dim"), matrix),
            wo=ParamSpec((H, dv, D), ("heads", "head_dim", "embed"), matrix),
            mlp_norm=ParamSpec((D,), ("embed",), norm),
        )
        kinds = set(self.layer_types(model))
        if DENSE_LAYER in kinds:
            specs.update({name: dataclasses.replace(spec, layer_type=DENSE_LAYER)
                          for name, spec in gated_mlp_matrices(model).items()})
        if MOE_LAYER in kinds:
            specs.update(expert_matrices(model, MOE_LAYER))
            if self.version.scoring == SIGMOID:
                specs[CORRECTION_BIAS] = ParamSpec((model.num_experts,), ("experts",), Role.BIAS, MOE_LAYER)
            shared = model.moe_intermediate_size * model.n_shared_experts
            specs.update(
                shared_gate=ParamSpec((D, shared), ("embed", "mlp"), matrix, MOE_LAYER),
                shared_up=ParamSpec((D, shared), ("embed", "mlp"), matrix, MOE_LAYER),
                shared_down=ParamSpec((shared, D), ("mlp", "embed"), matrix, MOE_LAYER),
            )
        return specs

    # ---------------------------------------------------------------- maths

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model, options):
        """x + latent attention(norm(x)), then the channel mixer."""
        # jlong.generation's prefill and decode wrap the training methods and take values of the keys' head
        # size only (their caches and one-query softmax): they get the heads padded to one size.
        projection = _projection(model, options.mlp_tile,
                                 one_head_size=not isinstance(options.sequence_parallel, SequenceParallelMethod))
        H = model.num_attention_heads
        params = projection.padded_output({name: p[name] for name in LATENT_PARAMS if name in p})
        x_BSD = options.sequence_parallel.attention(
            params, x_BSD, positions_BS, segment_ids_BS, projection=projection, heads=(H, H, H // options.head_stages),
            kernel=options.attention, shards=options.shards, unroll_stages=options.unroll_attention_stages)
        return self.channel_mixer(p, options.shards.constrain(x_BSD, HIDDEN), model, options)

    def channel_mixer(self, p, x_BSD, model, options):
        """x + swiglu(norm(x)) in a dense layer; x + experts(norm(x)) and the routing statistics in a mixture."""
        if options.layer_type == DENSE_LAYER:
            return options.shards.constrain(blocks.residual_swiglu(p, x_BSD, model, options), HIDDEN)
        x_BSD, statistics = blocks.residual_experts(p, x_BSD, model, self.mixture(model), options)
        return options.shards.constrain(x_BSD, HIDDEN), statistics

    def attention_projection(self, model: ModelConfig) -> LatentProjection:
        return _projection(model, 0, one_head_size=False)

    def mixture(self, model: ModelConfig) -> MixtureOfExperts:
        sigmoid = self.version.scoring == SIGMOID
        routing = GroupLimitedRouting(
            self.version.scoring, model.n_group, model.topk_group if self._grouped(model) else model.n_group,
            TWO_BEST if sigmoid else BEST, model.routed_scaling_factor)
        return MixtureOfExperts(model.num_experts, model.num_experts_per_tok, model.norm_topk_prob, grouped=routing,
                                correction_bias=sigmoid, shared_mlp=True)

    def flops_per_token(self, model: ModelConfig, seq_len: int) -> float:
        """6 x the matmul parameters per token, plus causal attention: per head and visible key, q.k over
        the query-key head size and p.v over the values', 2 x (dq + dv) forward, x3 with the backward."""
        per_key = 6 * model.num_attention_heads * (model.dim_per_head + model.v_head_dim)
        return 6 * self.matmul_params_per_token(model) + per_key * mean_visible_keys(seq_len) * model.num_hidden_layers

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        version, name = self.version, self.name
        hf = {**{key: value for key, value in version.hf_defaults.items() if key not in hf},
              **{key: value for key, value in hf.items() if value is not None or key == "q_lora_rank"}}
        scoring = hf.get("scoring_func", version.scoring)
        if scoring != version.scoring or hf.get("topk_method", version.topk_methods[0]) not in version.topk_methods:
            raise JlongError(f"{where}: scoring_func {scoring!r} with topk_method {hf.get('topk_method')!r} is not "
                             f"{name}'s routing ({version.scoring} scores, {' or '.join(version.topk_methods)}): "
                             "jlong would route the experts otherwise than the checkpoint was trained")
        rotated = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        if rotated != 1.0:
            raise JlongError(f"{where}: partial_rotary_factor {rotated} is not read by model.family={name}, which "
                             "rotates all of qk_rope_head_dim")
        if hf.get("rope_interleave") is False:
            raise JlongError(f"{where}: rope_interleave=false (rotary dimensions in halves) is not read by "
                             f"model.family={name}, which reads the interleaved pairs DeepSeek and GLM publish")
        fields = super().hf_fields({**hf, "head_dim": hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]}, where)
        fields.update({key: hf[key] for key in (*LATENT_FIELDS, *ROUTING_FIELDS) if key in hf})
        fields.update(num_experts=hf["n_routed_experts"], num_key_value_heads=hf.get("num_key_value_heads"),
                      topk_method=hf.get("topk_method", version.topk_methods[0]))
        for key in ("n_group", "topk_group"):
            fields[key] = hf.get(key) or 1
        if version.mlp_layer_types:
            kinds = hf.get("mlp_layer_types") or ["dense"] + [HF_SPARSE] * (hf["num_hidden_layers"] - 1)
            fields["layer_types"] = tuple(MOE_LAYER if kind == HF_SPARSE else kind for kind in kinds)
        else:
            fields["first_k_dense_replace"] = hf["first_k_dense_replace"]
        return fields

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        hf = super().hf_config(model)
        del hf["head_dim"]  # transformers' head_dim is the rotary part's (GLM's an alias of qk_rope_head_dim)
        hf.update({key: getattr(model, key) for key in (*LATENT_FIELDS, *ROUTING_FIELDS)})
        hf.update(n_routed_experts=model.num_experts, topk_method=model.topk_method, hidden_act="silu",
                  scoring_func=self.version.scoring, router_aux_loss_coef=model.router_aux_loss_coef,
                  attention_bias=False)
        if self.version.mlp_layer_types:
            hf["mlp_layer_types"] = [HF_SPARSE if kind == MOE_LAYER else kind for kind in self.layer_types(model)]
        else:
            hf["first_k_dense_replace"] = self.layer_types(model).count(DENSE_LAYER)
        if self.version.scoring == SIGMOID:
            hf["rope_interleave"] = True
        return hf

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        D, H = model.hidden_size, model.num_attention_heads
        dq, dn, dv, dr = model.dim_per_head, model.qk_nope_head_dim, model.v_head_dim, model.qk_rope_head_dim
        Rq, Rkv = model.q_lora_rank, model.kv_lora_rank
        queries, kv_a = _halves_after(dn, dr), _halves_after(Rkv, dr)

        def heads(name, inputs, size, order=None):
            """A linear layer [H x size, in] as [in, H, size], the last axis reordered by `order`."""
            if order is None:
                return HFTensor(name, lambda w: w.T.reshape(inputs, H, size), lambda w: w.reshape(inputs, H * size).T)
            back = np.argsort(order)
            return HFTensor(name, lambda w: w.T.reshape(inputs, H, size)[..., order],
                            lambda w: w[..., back].reshape(inputs, H * size).T,
                            output_order=tuple((np.arange(H)[:, None] * size + back).ravel().tolist()))

        tensors = {
            "attn_norm": HFTensor("input_layernorm.weight"),
            "wq": heads("self_attn.q_proj.weight", D, dq, queries),
            "wq_a": HFTensor("self_attn.q_a_proj.weight", **TRANSPOSED),
            "q_a_norm": HFTensor("self_attn.q_a_layernorm.weight"),
            "wq_b": heads("self_attn.q_b_proj.weight", Rq, dq, queries),
            "wkv_a": HFTensor("self_attn.kv_a_proj_with_mqa.weight", lambda w: w.T[:, kv_a],
                              lambda w: w[:, np.argsort(kv_a)].T, output_order=tuple(np.argsort(kv_a).tolist())),
            "kv_a_norm": HFTensor("self_attn.kv_a_layernorm.weight"),
            "wkv_b": heads("self_attn.kv_b_proj.weight", Rkv, dn + dv),
            "wo": HFTensor("self_attn.o_proj.weight", lambda w: w.T.reshape(H, dv, D),
                           lambda w: w.reshape(H * dv, D).T),
            "mlp_norm": HFTensor("post_attention_layernorm.weight"),
            **{name: HFTensor(f"mlp.{name.removeprefix('w_')}_proj.weight", **TRANSPOSED)
               for name in ("w_gate", "w_up", "w_down")},
            **hf_expert_tensors(model),
            CORRECTION_BIAS: HFTensor("mlp.gate.e_score_correction_bias"),
            **{name: HFTensor(f"mlp.shared_experts.{projection}.weight", **TRANSPOSED)
               for name, projection in SHARED_EXPERTS.items()},
        }
        return {name: tensors[name] for name in self.layer_params(model)}


def _halves_after(kept: int, rotary: int) -> np.ndarray:
    """The order that takes a row of `kept` columns and `rotary` columns in interleaved pairs (the
    checkpoints' rotary layout) to the same `kept` columns and the pairs' first members, then their second
    (jlong's halves)."""
    return np.concatenate([np.arange(kept), kept + np.arange(0, rotary, 2), kept + np.arange(1, rotary, 2)])


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale_correction(model: ModelConfig) -> float:
    """What the softmax scale dq^-1/2 is multiplied by: YaRN's mscale_all_dim correction squared, as
    DeepSeek's attention applies it with any scaled RoPE that sets it."""
    scaling = model.rope_scaling or {}
    if rope_type(model) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


@functools.lru_cache(maxsize=64)
def _projection(model: ModelConfig, tile: int, one_head_size: bool) -> LatentProjection:
    rotary = model.model_copy(update={"head_dim": model.qk_rope_head_dim, "partial_rotary_factor": None})
    return LatentProjection(
        norm_eps=model.rms_norm_eps, rope_inv_freq=tuple(rope_inverse_frequencies(rotary).tolist()),
        qk_nope_head_dim=model.qk_nope_head_dim, kv_lora_rank=model.kv_lora_rank,
        rope_scale=rope_attention_factor(model), query_scale=softmax_scale_correction(model), tile=tile,
        one_head_size=one_head_size)


DEEPSEEK_V2 = DeepseekFamily("deepseek_v2", "DeepseekV2ForCausalLM", version=V2)
DEEPSEEK_V3 = DeepseekFamily("deepseek_v3", "DeepseekV3ForCausalLM", version=V3)
GLM4_MOE_LITE = DeepseekFamily("glm4_moe_lite", "Glm4MoeLiteForCausalLM", version=GLM)
