"""What the mixture-of-experts families (Qwen3-MoE, Qwen3.5-MoE) share: the
experts' config fields and checks, their Hugging Face names, and the mixture
(`jlong.moe.experts.MixtureOfExperts`) a config describes.

Checkpoints store each expert's projections as tensors of their own,
`mlp.experts.{e}.gate_proj.weight` and so on (transformers fuses them only in
memory); jlong stacks them into one [E, ...] parameter per projection.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jlong.errors import JlongError
from jlong.families.base import TRANSPOSED, HFTensor
from jlong.moe.experts import MixtureOfExperts

if TYPE_CHECKING:
    from jlong.config import ModelConfig

# The config.json keys that are jlong `model` fields by the same name.
HF_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "output_router_logits",
           "router_aux_loss_coef")
REQUIRED = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


def check_experts(model: ModelConfig, label: str) -> None:
    """One-line errors for a mixture that `label` (the family) cannot be."""
    unset = [key for key in REQUIRED if getattr(model, key) is None]
    if unset:
        raise JlongError(f"model.family={label} is a mixture of experts: set model.{', model.'.join(unset)}")
    if model.num_experts_per_tok > model.num_experts:
        raise JlongError(f"model.num_experts_per_tok ({model.num_experts_per_tok}) is more than model.num_experts "
                         f"({model.num_experts})")


def mixture_of(model: ModelConfig, *, shared_expert: bool) -> MixtureOfExperts:
    return MixtureOfExperts(model.num_experts, model.num_experts_per_tok, model.norm_topk_prob, shared_expert)


def hf_expert_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The experts' `model` fields of a config.json (which may write the
    number of experts as `num_local_experts`)."""
    hf = {**hf, "num_experts": hf.get("num_experts", hf.get("num_local_experts"))}
    return {key: hf[key] for key in HF_KEYS if hf.get(key) is not None}


def hf_expert_config(model: ModelConfig) -> dict[str, Any]:
    return {key: getattr(model, key) for key in HF_KEYS}


def hf_expert_tensors(model: ModelConfig) -> dict[str, HFTensor]:
    """The router's and the experts' tensors within `model.layers.{i}.`."""
    def each_expert(projection: str) -> HFTensor:
        return HFTensor(f"mlp.experts.{{part}}.{projection}.weight", **TRANSPOSED, parts=model.num_experts)

    return {
        "router": HFTensor("mlp.gate.weight", **TRANSPOSED),
        "expert_gate": each_expert("gate_proj"),
        "expert_up": each_expert("up_proj"),
        "expert_down": each_expert("down_proj"),
    }
