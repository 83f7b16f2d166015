"""Model FLOPs per token (for MFU) and the peak FLOP/s of known accelerators."""

from __future__ import annotations

import jax

from jlong.config import ModelConfig
from jlong.planner.targets import GPUS

# Dense bf16 tensor-core peaks (FLOP/s), by device_kind substring: the planner's
# GPU table, and the A100, which jlong does not plan for but may run on.
PEAK_BF16_FLOPS = {"A100": 312e12, **{name.upper(): gpu.peak_bf16_flops for name, gpu in GPUS.items()}}


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per training token, the convention MFU is quoted in: 6 x
    matmul parameters (forward 2, backward 4), plus causal attention (QK^T
    and PV: 4 x S x d per head forward, halved by the mask, x3 with the
    backward pass). Recomputation is not counted."""
    D, F, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    H, K, d = config.num_attention_heads, config.kv_heads, config.dim_per_head
    per_layer = D * (H + 2 * K) * d + H * d * D + 3 * D * F
    matmul_params = L * per_layer + D * config.vocab_size
    attention = 6 * L * H * d * seq_len
    return 6 * matmul_params + attention


def peak_flops_per_device() -> float | None:
    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    for name, flops in PEAK_BF16_FLOPS.items():
        if name in device.device_kind:
            return flops
    return None
