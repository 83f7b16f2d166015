"""Next-token cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits_BSV, targets_BS, mask_BS=None):
    """Mean over the (unmasked) target tokens, computed in float32."""
    logits = logits_BSV.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - target_logit
    if mask_BS is None:
        return losses.mean()
    mask = mask_BS.astype(jnp.float32)
    return (losses * mask).sum() / jnp.maximum(mask.sum(), 1.0)
