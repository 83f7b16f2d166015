"""Stateless building blocks of the decoder: RMSNorm, rotary embeddings, SwiGLU and GeGLU."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jlong.ops.adapted import matmul

if TYPE_CHECKING:
    from jlong.config import ModelConfig


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, computed in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


def rope_type(config: ModelConfig) -> str:
    """The RoPE scaling method: "default" (none), "linear", "llama3" or "yarn"."""
    scaling = config.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """Per-pair rotation rates [rotary_dims/2] (every pair of a head, or the
    first partial_rotary_factor of them), scaled as model.rope_scaling says
    (Hugging Face's definitions: `linear`, `llama3`, `yarn`)."""
    dim = config.rotary_dims
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling, kind = config.rope_scaling, rope_type(config)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn_scaled(inv_freq, scaling, config.rope_theta, dim)
    return inv_freq.astype(np.float32)


def rope_attention_factor(config: ModelConfig) -> float:
    """What RoPE's cos and sin are multiplied by (so q.k by its square): YaRN's
    attention factor, 1 for the other methods."""
    if rope_type(config) != "yarn":
        return 1.0
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dims = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dims:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims)
    return _yarn_mscale(factor)


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaled(inv_freq: np.ndarray, scaling: dict, theta: float, dim: int) -> np.ndarray:
    """YaRN (arXiv 2309.00071): pairs that turn fewer than `beta_slow` times
    over the original context are interpolated (slowed by `factor`), those
    that turn more than `beta_fast` times kept, with a linear ramp between."""
    factor, old_context = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def pair_turning(rotations):  # the (fractional) pair index that turns `rotations` times over the old context
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_turning(fast), pair_turning(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of each pair's original rate
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def apply_rope(x_BSNd, positions_BS, inv_freq, scale: float = 1.0):
    """Rotates the two halves of each head's first 2 x len(inv_freq)
    dimensions (the Hugging Face layout; the rest pass unrotated); `scale`
    multiplies cos and sin (YaRN's attention factor)."""
    rotary = 2 * len(inv_freq)
    if rotary < x_BSNd.shape[-1]:
        rotated = apply_rope(x_BSNd[..., :rotary], positions_BS, inv_freq, scale)
        return jnp.concatenate([rotated, x_BSNd[..., rotary:]], axis=-1)
    angles = positions_BS.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, S, 1, d/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    x1, x2 = jnp.split(x_BSNd.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BSNd.dtype)


def swiglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD):
    """The gated MLP with SiLU (its weights may carry LoRA adapters: `jlong.ops.adapted`)."""
    gate, up = matmul(x_BSD, w_gate_DF, inputs=1), matmul(x_BSD, w_up_DF, inputs=1)
    return matmul(jax.nn.silu(gate) * up, w_down_FD, inputs=1)


def geglu(x_BSD, w_gate_DF, w_up_DF, w_down_FD):
    """The gated MLP with GELU's tanh approximation (Gemma's gelu_pytorch_tanh)."""
    gate, up = matmul(x_BSD, w_gate_DF, inputs=1), matmul(x_BSD, w_up_DF, inputs=1)
    return matmul(jax.nn.gelu(gate, approximate=True) * up, w_down_FD, inputs=1)
