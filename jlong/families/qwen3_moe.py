"""Qwen3-MoE (`qwen3_moe`): Qwen 3's layers (per-head q/k norms) whose
channel mixer is a mixture of SwiGLU experts (`jlong.moe.experts`): a
softmax router picks `num_experts_per_tok` of `num_experts` experts per
token, their probabilities renormalised when `norm_topk_prob`.

A layer is "moe" or "dense" (a plain SwiGLU MLP of `intermediate_size`):
dense where `mlp_only_layers` lists it or where it is not every
`decoder_sparse_step`-th layer, as transformers decides; published models
are sparse throughout. The experts' parameters are stacked over the sparse
layers alone, the MLP's over the dense ones.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.base import HFTensor
from jlong.families.llama import LlamaFamily
from jlong.families.moe import (check_experts, hf_expert_config, hf_expert_fields, hf_expert_tensors,
                                mixture_of)
from jlong.families.params import ParamSpec, expert_matrices
from jlong.ops.shards import HIDDEN

if TYPE_CHECKING:
    from jlong.config import ModelConfig

MOE_LAYER, DENSE_LAYER = "moe", "dense"
DENSE_MLP = ("w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class Qwen3MoeFamily(LlamaFamily):
    @property
    def known_layer_types(self) -> tuple[str, ...]:
        return (MOE_LAYER, DENSE_LAYER)

    def check(self, model: ModelConfig) -> None:
        super().check(model)
        check_experts(model, self.name)
        self.check_layer_types(model, "Qwen3-MoE")

    def layer_types(self, model: ModelConfig) -> tuple[str, ...]:
        if model.layer_types is not None:
            return tuple(model.layer_types)
        dense, every = set(model.mlp_only_layers or ()), model.decoder_sparse_step or 1
        return tuple(MOE_LAYER if i not in dense and (i + 1) % every == 0 else DENSE_LAYER
                     for i in range(model.num_hidden_layers))

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        specs = super().layer_params(model)
        kinds = set(self.layer_types(model))
        mlp = {name: specs.pop(name) for name in DENSE_MLP}
        if DENSE_LAYER in kinds:
            specs.update({name: dataclasses.replace(spec, layer_type=DENSE_LAYER) for name, spec in mlp.items()})
        if MOE_LAYER in kinds:
            specs.update(expert_matrices(model, MOE_LAYER))
        return specs

    def channel_mixer(self, p, x_BSD, model, options):
        """x + swiglu(norm(x)) in a dense layer; x + experts(norm(x)) and its routing statistics in a sparse one."""
        if options.layer_type == DENSE_LAYER:
            return super().channel_mixer(p, x_BSD, model, options)
        x_BSD, statistics = blocks.residual_experts(p, x_BSD, model, mixture_of(model, shared_expert=False),
                                                    options)
        return options.shards.constrain(x_BSD, HIDDEN), statistics

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("use_sliding_window"):
            raise JlongError(f"{where}: use_sliding_window=true is not supported (Qwen3-MoE is released without)")
        fields = {**super().hf_fields(hf, where), **hf_expert_fields(hf)}
        fields["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))
        fields["decoder_sparse_step"] = int(hf.get("decoder_sparse_step") or 1)
        fields["mlp_only_layers"] = tuple(hf.get("mlp_only_layers") or ())
        return fields

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        kinds = self.layer_types(model)
        dense = [i for i, kind in enumerate(kinds) if kind == DENSE_LAYER]
        return {**super().hf_config(model), **hf_expert_config(model), "norm_topk_prob": model.norm_topk_prob,
                "decoder_sparse_step": 1, "mlp_only_layers": dense}

    def hf_tensor_table(self, model: ModelConfig) -> dict[str, HFTensor]:
        return {**super().hf_tensor_table(model), **hf_expert_tensors(model)}


QWEN3_MOE = Qwen3MoeFamily("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True)
