"""AdamW with global-norm clipping and a warmup + cosine learning-rate schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jlong.config import TrainConfig


def learning_rate(train: TrainConfig, step):
    """The learning rate of 1-based step `step`: linear warmup to lr over
    warmup_steps (step 1 already moves), then cosine decay to
    min_lr_ratio x lr at the last step."""
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    step = jnp.asarray(step, jnp.float32)
    warm = peak * step / max(train.warmup_steps, 1)
    progress = jnp.clip((step - train.warmup_steps) / max(train.steps - train.warmup_steps, 1), 0.0, 1.0)
    cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step <= train.warmup_steps, warm, cosine)


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """optax counts updates from 0; update number c is step c + 1."""
    return lambda count: learning_rate(train, count + 1)


def decays(params) -> dict:
    """Weight decay applies to weight matrices, not to norms and biases."""

    def is_matrix(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name.endswith("norm") or name in ("bq", "bk", "bv"))

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def clipping(train: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping (stateless); identity when train.grad_clip is 0."""
    return optax.clip_by_global_norm(train.grad_clip) if train.grad_clip > 0 else optax.identity()


def adamw(train: TrainConfig) -> optax.GradientTransformation:
    """AdamW with the schedule; elementwise, so it may update parameters piece by piece."""
    return optax.adamw(
        learning_rate_schedule(train),
        b1=train.b1,
        b2=train.b2,
        eps=train.eps,
        weight_decay=train.weight_decay,
        mask=decays,
    )


def state_shardings(optimizer: optax.GradientTransformation, state_shapes, param_shardings, counters_sharding):
    """Shardings of `optimizer`'s state: the moments placed like their
    parameters, everything else (step counters) in `counters_sharding`."""
    return optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, state_shapes, param_shardings,
        transform_non_params=lambda _: counters_sharding,
    )


def make_optimizer(train: TrainConfig) -> optax.GradientTransformation:
    return optax.chain(clipping(train), adamw(train))
