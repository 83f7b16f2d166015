"""Which weights a run adapts, and the adapters' parameters.

A run names its targets as PEFT's `target_modules` does: the last part of
a Hugging Face module's name (`q_proj`, `down_proj`, `in_proj_qkv`, ...) or
`all-linear`. Each names one of jlong's layer matrices, found through the
family's Hugging Face tensor table, so every family that can read a
Hugging Face checkpoint can be adapted. `all-linear` is every adaptable
matrix the family has: attention's and Gated DeltaNet's projections (latent
attention's too: `q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`,
`o_proj`) and the dense (or shared-expert) MLP's (DeepSeek's and GLM's
`shared_experts.gate_proj`, `up_proj`, `down_proj`).

It is close to PEFT's `all-linear` (every `nn.Linear` but the output
layer), not the same: PEFT also takes a Qwen3.5-MoE's one-output
`shared_expert_gate` and routers that are `nn.Linear`, which stay frozen
here. A mixture's routed experts are not adapted: transformers 5 keeps
them as fused 3-D parameters (`mlp.experts.gate_up_proj`), which PEFT
reaches only through `target_parameters` and its `all-linear` leaves
alone. The PEFT directory jlong writes names its targets, so PEFT adapts
exactly jlong's modules (`jlong.lora.peft_format`, which also says what
PEFT cannot load: a Qwen3-MoE dense layer's MLP).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jlong.errors import JlongError
from jlong.families import ParamSpec, Role, family_of

if TYPE_CHECKING:
    from jlong.config import ModelConfig

ALL_LINEAR = "all-linear"
RANK_AXIS = "lora_rank"  # the logical axis of the adapters' rank (`jlong.parallel.placement`)
SUFFIXES = ("_lora_a", "_lora_b")

# jlong's adaptable layer matrices and how many of their leading axes are inputs.
INPUT_AXES = {
    "wq": 1, "wk": 1, "wv": 1, "wo": 2,
    "w_gate": 1, "w_up": 1, "w_down": 1,
    "gdn_qkv": 1, "gdn_z": 1, "gdn_b": 1, "gdn_a": 1, "gdn_out": 2,
    "wq_a": 1, "wq_b": 1, "wkv_a": 1, "wkv_b": 1,  # latent attention's (`jlong.attention.latent`)
    "shared_gate": 1, "shared_up": 1, "shared_down": 1,  # DeepSeek's and GLM's shared experts
}
EXPERT_MATRICES = ("expert_gate", "expert_up", "expert_gate_up", "expert_down")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """What the model needs to know of a LoRA run (`lora:`), targets resolved."""

    rank: int
    alpha: float
    targets: tuple[str, ...]  # jlong layer matrices, in the family's order
    base_dtype: str = "compute"  # "compute" (the compute dtype) or "nf4"

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by: alpha / rank, as PEFT's `scaling`."""
        return self.alpha / self.rank

    @property
    def adapter_names(self) -> tuple[str, ...]:
        return tuple(target + suffix for target in self.targets for suffix in SUFFIXES)


def hf_modules(model: ModelConfig) -> dict[str, str]:
    """Each adaptable matrix of the family -> its Hugging Face module within a
    layer (`self_attn.q_proj`), in the family's parameter order."""
    family = family_of(model)
    tensors = family.hf_layer_tensors(model)
    return {name: tensors[name].name.removesuffix(".weight") for name in family.layer_params(model)
            if name in INPUT_AXES}


def resolve_targets(model: ModelConfig, targets: str | tuple[str, ...]) -> tuple[str, ...]:
    """`lora.targets` as jlong's matrix names; a one-line error for a name the family lacks."""
    modules = hf_modules(model)
    if targets == ALL_LINEAR or targets == (ALL_LINEAR,):
        return tuple(modules)
    by_short_name: dict[str, list[str]] = {}
    for name, module in modules.items():
        by_short_name.setdefault(module.rsplit(".", 1)[-1], []).append(name)
    chosen = []
    for target in targets:
        if "experts" in target or target == "gate_up_proj":
            raise JlongError(f"lora.targets {target!r}: the experts of a mixture are not adapted (PEFT's "
                             "all-linear leaves their fused parameters too); adapt attention and dense layers")
        if target not in by_short_name:
            raise JlongError(f"lora.targets {target!r} is not a linear layer of model.family={model.family}: "
                             f"choose from {', '.join(sorted(by_short_name))} or all-linear")
        chosen += by_short_name[target]
    return tuple(name for name in modules if name in chosen)


def adapter_specs(model: ModelConfig, lora: LoraSettings) -> dict[str, ParamSpec]:
    """The adapters' layer parameters: for each target w [*inputs, *outputs],
    `{w}_lora_a` [*inputs, r] (PEFT's Kaiming-uniform start, bound
    1/sqrt(fan_in)) and `{w}_lora_b` [r, *outputs] (zeros: the adapted model
    starts as the base), stacked over the layers that have w."""
    base = family_of(model).layer_params(model)
    specs = {}
    for name in lora.targets:
        spec, n = base[name], INPUT_AXES[name]
        fan_in = math.prod(spec.shape[:n])
        specs[name + "_lora_a"] = ParamSpec(
            (*spec.shape[:n], lora.rank), (*spec.axes[:n], RANK_AXIS), Role.MATRIX, spec.layer_type,
            init=_kaiming_uniform(fan_in))
        specs[name + "_lora_b"] = ParamSpec(
            (lora.rank, *spec.shape[n:]), (RANK_AXIS, *spec.axes[n:]), Role.MATRIX, spec.layer_type, init=_zeros)
    return specs


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


def _kaiming_uniform(fan_in: int):
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype):
        return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)

    return init


def _zeros(key, shape, dtype):
    return jnp.zeros(shape, dtype)


def adapted_layer(p: dict, lora: LoraSettings) -> dict:
    """One layer's parameters by name (in the compute dtype) with each target
    and its two adapters joined into one `Adapted` weight under the target's
    name, b scaled by alpha / rank."""
    from jlong.ops.adapted import Adapted

    p = dict(p)
    for name in lora.targets:
        if name in p:
            a, b = p.pop(name + "_lora_a"), p.pop(name + "_lora_b")
            b = (b.astype(jnp.float32) * lora.scale).astype(b.dtype)
            p[name] = Adapted(p[name], a, b, INPUT_AXES[name])
    return p


def lora_settings(section, model: ModelConfig) -> LoraSettings | None:
    """A config's `lora` section (None: no LoRA) with its targets resolved for `model`."""
    if section is None:
        return None
    return LoraSettings(section.rank, float(section.alpha), resolve_targets(model, section.targets), section.base_dtype)
