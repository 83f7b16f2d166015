"""Qwen3.5-MoE (`qwen3_5_moe_text`): the Qwen3.5 hybrid (Gated DeltaNet
layers, gated full attention every fourth; `jlong.families.qwen3_5`) whose
channel mixer in every layer is a mixture of SwiGLU experts plus a shared
expert (`jlong.moe.experts`): the router's top `num_experts_per_tok`
probabilities, always renormalised, weight the routed experts; the shared
expert is a SwiGLU every token runs, scaled by sigmoid(h . w) with its own
gate vector w.

jlong keeps the shared expert as the layer's MLP, of `intermediate_size`:
config.json calls that size `shared_expert_intermediate_size` and has no
`intermediate_size`. Image-text `qwen3_5_moe` checkpoints are read for their
text model, as Qwen3.5's are.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import HFTensor
from jlong.families.moe import (check_experts, hf_expert_config, hf_expert_fields, hf_expert_tensors,
                                mixture_of)
from jlong.families.params import ParamSpec, Role, expert_matrices
from jlong.families.qwen3_5 import Qwen3_5Family
from jlong.ops.shards import HIDDEN

if TYPE_CHECKING:
    from jlong.config import ModelConfig

# Qwen3_5MoeTextConfig's defaults for the experts, for the fields a config.json leaves out.
HF_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512, "router_aux_loss_coef": 0.001}
SHARED_EXPERT = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class Qwen3_5MoeFamily(Qwen3_5Family):
    def config_defaults(self) -> dict[str, Any]:
        return {**super().config_defaults(), "norm_topk_prob": True}

    def check(self, model: ModelConfig) -> None:
        super().check(model)
        check_experts(model, self.name)
        if not model.norm_topk_prob:
            raise JlongError(f"model.family={self.name} always renormalises its top-k probabilities: drop "
                             "model.norm_topk_prob")

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        return {**super().layer_params(model), **expert_matrices(model),
                "shared_expert_gate": ParamSpec((model.hidden_size,), ("embed",), Role.MATRIX)}

    def channel_mixer(self, p, x_BSD, model, options):
        """x + the routed experts' and the gated shared expert's outputs of norm(x), and the routing statistics."""
        x_BSD, statistics = blocks.residual_experts(p, x_BSD, model, mixture_of(model, shared_expert=True), options)
        return options.shards.constrain(x_BSD, HIDDEN), statistics

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        hf = {**HF_DEFAULTS, **{key: value for key, value in hf.items() if value is not None}}
        fields = {**super().hf_fields({**hf, "intermediate_size": hf["shared_expert_intermediate_size"]}, where),
                  **hf_expert_fields(hf)}
        fields["norm_topk_prob"] = True
        return fields

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        hf = {**super().hf_config(model), **hf_expert_config(model)}
        hf["shared_expert_intermediate_size"] = hf.pop("intermediate_size")
        return hf

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        tensors = super().hf_layer_tensors(model)
        for name, projection in SHARED_EXPERT.items():
            tensors[name] = dataclasses.replace(tensors[name], name=f"mlp.shared_expert.{projection}.weight")
        return {**tensors, **hf_expert_tensors(model),
                "shared_expert_gate": HFTensor("mlp.shared_expert_gate.weight", lambda w: w[0], lambda w: w[None])}


QWEN3_5_MOE_TEXT = Qwen3_5MoeFamily("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")
