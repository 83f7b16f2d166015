"""The parameter layout: every parameter's shape, logical axes and role.

The role decides what everything else does with a parameter: how it starts
(`Role.initial`), whether AdamW decays it (`Role.decays`), which Hugging
Face tensors are norms or biases. The model, the optimizers and the PyTorch
baseline read it here rather than guessing from names.

Layer parameters are listed without their leading `layers` axis (the model
stacks them); their names are unique across the whole parameter dict, so a
leaf's name finds its entry wherever it sits.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jlong.config import ModelConfig

INIT_STD = 0.02  # the initializer_range of the Hugging Face configs


class Role(enum.Enum):
    EMBEDDING = "embedding"  # the token embedding and the output projection
    MATRIX = "matrix"  # a layer's weight matrix
    NORM = "norm"  # an RMSNorm scale
    BIAS = "bias"

    @property
    def decays(self) -> bool:
        """AdamW's weight decay applies to matrices, not to norms and biases."""
        return self in (Role.EMBEDDING, Role.MATRIX)

    def initial(self, key, shape, dtype):
        if self is Role.NORM:
            return jnp.ones(shape, dtype)
        if self is Role.BIAS:
            return jnp.zeros(shape, dtype)
        return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]  # logical axis names (`jlong.parallel.placement`)
    role: Role


def layer_params(config: ModelConfig) -> dict[str, ParamSpec]:
    """Each per-layer parameter (without the layers axis)."""
    D, F = config.hidden_size, config.intermediate_size
    H, K, d = config.num_attention_heads, config.kv_heads, config.dim_per_head
    matrix, norm, bias = Role.MATRIX, Role.NORM, Role.BIAS
    specs = {
        "attn_norm": ParamSpec((D,), ("embed",), norm),
        "wq": ParamSpec((D, H, d), ("embed", "heads", "head_dim"), matrix),
        "wk": ParamSpec((D, K, d), ("embed", "kv_heads", "head_dim"), matrix),
        "wv": ParamSpec((D, K, d), ("embed", "kv_heads", "head_dim"), matrix),
        "wo": ParamSpec((H, d, D), ("heads", "head_dim", "embed"), matrix),
        "mlp_norm": ParamSpec((D,), ("embed",), norm),
        "w_gate": ParamSpec((D, F), ("embed", "mlp"), matrix),
        "w_up": ParamSpec((D, F), ("embed", "mlp"), matrix),
        "w_down": ParamSpec((F, D), ("mlp", "embed"), matrix),
    }
    if config.attention_bias:
        specs["bq"] = ParamSpec((H, d), ("heads", "head_dim"), bias)
        specs["bk"] = ParamSpec((K, d), ("kv_heads", "head_dim"), bias)
        specs["bv"] = ParamSpec((K, d), ("kv_heads", "head_dim"), bias)
    if config.qk_norm:
        specs["q_norm"] = ParamSpec((d,), ("head_dim",), norm)
        specs["k_norm"] = ParamSpec((d,), ("head_dim",), norm)
    return specs


def outer_params(config: ModelConfig) -> dict[str, ParamSpec]:
    """The parameters outside the layers: embedding, final norm, output projection."""
    V, D = config.vocab_size, config.hidden_size
    specs = {
        "embed": ParamSpec((V, D), ("vocab", "embed"), Role.EMBEDDING),
        "final_norm": ParamSpec((D,), ("embed",), Role.NORM),
    }
    if not config.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), Role.EMBEDDING)
    return specs


def roles(config: ModelConfig) -> dict[str, Role]:
    """The role of each parameter, by its leaf's name in the parameter dict."""
    return {name: spec.role for name, spec in {**outer_params(config), **layer_params(config)}.items()}


def decay_mask(config: ModelConfig, params) -> dict:
    """True for each leaf of `params` (the whole dict or any part of it) that AdamW decays."""
    role = roles(config)
    return jax.tree_util.tree_map_with_path(lambda path, _: role[path[-1].key].decays, params)
