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

import jax
import jax.numpy as jnp

INIT_STD = 0.02  # the initializer_range of the Hugging Face configs


class Role(enum.Enum):
    EMBEDDING = "embedding"  # the token embedding and the output projection
    MATRIX = "matrix"  # a layer's weight matrix
    NORM = "norm"  # an RMSNorm scale
    NORM_OFFSET = "norm_offset"  # an RMSNorm scale kept as its offset from one (Gemma: x * (1 + w))
    BIAS = "bias"

    @property
    def decays(self) -> bool:
        """AdamW's weight decay applies to matrices, not to norms and biases."""
        return self in (Role.EMBEDDING, Role.MATRIX)

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
