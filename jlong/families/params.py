"""What a family's parameter layout is made of: each parameter's shape,
logical axes and role.

The role decides what everything else does with a parameter: how it starts
(`Role.initial`), whether AdamW decays it (`Role.decays`), which Hugging
Face tensors are norms or biases. The model, the optimizers and the PyTorch
baseline read it from the family's layout rather than guessing from names.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from jlong.config import ModelConfig

INIT_STD = 0.02  # the initializer_range of the Hugging Face configs


class Role(enum.Enum):
    EMBEDDING = "embedding"  # the token embedding and the output projection
    MATRIX = "matrix"  # a layer's weight matrix
    NORM = "norm"  # an RMSNorm scale
    NORM_OFFSET = "norm_offset"  # an RMSNorm scale kept as its offset from one (Gemma: x * (1 + w))
    BIAS = "bias"
    CONV = "conv"  # a convolution's taps (linear attention's short causal convolution)

    @property
    def decays(self) -> bool:
        """AdamW's weight decay applies to matrices, not to norms and biases."""
        return self in (Role.EMBEDDING, Role.MATRIX, Role.CONV)

    def initial(self, key, shape, dtype):
        if self is Role.NORM:
            return jnp.ones(shape, dtype)
        if self in (Role.BIAS, Role.NORM_OFFSET):
            return jnp.zeros(shape, dtype)
        return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names (`jlong.parallel.placement`)
    role: Role
    # A layer parameter that only layers of this type have (stacked over those layers alone); None: every layer.
    layer_type: str | None = None
    # How it starts, when not as its role says: (key, shape, dtype) -> array.
    init: Callable | None = None

    def initial(self, key, shape, dtype):
        """Its starting value, of `shape` (its own, or stacked over layers)."""
        return (self.init or self.role.initial)(key, shape, dtype)


def attention_matrices(model: ModelConfig) -> dict[str, ParamSpec]:
    """The q, k, v and output projections, with the head axis explicit (so
    attention can take any subset of heads)."""
    D, H, K, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dim_per_head
    return {
        "wq": ParamSpec((D, H, d), ("embed", "heads", "head_dim"), Role.MATRIX),
        "wk": ParamSpec((D, K, d), ("embed", "kv_heads", "head_dim"), Role.MATRIX),
        "wv": ParamSpec((D, K, d), ("embed", "kv_heads", "head_dim"), Role.MATRIX),
        "wo": ParamSpec((H, d, D), ("heads", "head_dim", "embed"), Role.MATRIX),
    }


def gated_mlp_matrices(model: ModelConfig) -> dict[str, ParamSpec]:
    """A gated MLP's gate, up and down projections (SwiGLU, GeGLU)."""
    D, F = model.hidden_size, model.intermediate_size
    return {
        "w_gate": ParamSpec((D, F), ("embed", "mlp"), Role.MATRIX),
        "w_up": ParamSpec((D, F), ("embed", "mlp"), Role.MATRIX),
        "w_down": ParamSpec((F, D), ("mlp", "embed"), Role.MATRIX),
    }


def expert_matrices(model: ModelConfig, layer_type: str | None = None) -> dict[str, ParamSpec]:
    """A mixture of experts' router [D, E] and its SwiGLU experts' gate, up
    and down projections [E, D, F], [E, F, D] (`jlong.moe.experts`), for
    every layer or those of `layer_type`."""
    D, E, F = model.hidden_size, model.num_experts, model.moe_intermediate_size
    return {
        "router": ParamSpec((D, E), ("embed", "experts"), Role.MATRIX, layer_type),
        "expert_gate": ParamSpec((E, D, F), ("experts", "embed", "mlp"), Role.MATRIX, layer_type),
        "expert_up": ParamSpec((E, D, F), ("experts", "embed", "mlp"), Role.MATRIX, layer_type),
        "expert_down": ParamSpec((E, F, D), ("experts", "mlp", "embed"), Role.MATRIX, layer_type),
    }
