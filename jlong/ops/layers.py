"""Stateless building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jlong.config import ModelConfig


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation rates [head_dim/2], with Llama 3 scaling when configured."""
    dim = config.dim_per_head
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq.astype(np.float32)


def _llama3_scaled(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`,
    short ones kept, a smooth blend between the two cut-offs."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = np.where(wavelength > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= old_context / high) & (wavelength <= old_context / low)
    return np.where(medium, blended, scaled)


def apply_rope(x_BSNd, positions_BS, inv_freq):
    """Rotates the two halves of each head (the Hugging Face layout)."""
    angles = positions_BS.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, S, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x_BSNd.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BSNd.dtype)


def swiglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD):
    gate = jnp.einsum("bsd,df->bsf", x_BSD, w_gate_DF)
    up = jnp.einsum("bsd,df->bsf", x_BSD, w_up_DF)
    return jnp.einsum("bsf,fd->bsd", jax.nn.silu(gate) * up, w_down_FD)
