"""Model FLOPs per token: the convention MFU is quoted in."""

from __future__ import annotations

from jlong.config import ModelConfig


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per training token: 6 x matmul parameters (forward 2,
    backward 4), plus causal attention (QK^T and PV: 4 x S x d per head
    forward, halved by the mask, x3 with the backward pass). Recomputation is
    not counted."""
    D, F, L = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    H, K, d = config.num_attention_heads, config.kv_heads, config.dim_per_head
    per_layer = D * (H + 2 * K) * d + H * d * D + 3 * D * F
    matmul_params = L * per_layer + D * config.vocab_size
    attention = 6 * L * H * d * seq_len
    return 6 * matmul_params + attention
