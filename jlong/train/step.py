"""One optimizer step, jitted over the mesh with donated parameters and state."""

from __future__ import annotations

import jax
import optax

from jlong.parallel.mesh import ACTIVATION_RULES, batch_sharding, replicated
from jlong.sharding import use_rules
from jlong.train.loss import cross_entropy, tiled_cross_entropy
from jlong.train.state import Model


def make_loss_fn(model: Model):
    def loss_fn(params, batch):
        with use_rules(model.mesh, ACTIVATION_RULES):
            transformer = model.bind(params)
            hidden = transformer.hidden_states(batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
            targets, mask = batch["targets"], batch.get("loss_mask")
            if tile := model.config.memory.loss_tile:
                w = transformer.output_weights(hidden.dtype)
                return tiled_cross_entropy(hidden, w, targets, mask, tile=tile)
            return cross_entropy(transformer.logits(hidden), targets, mask)

    return loss_fn


def make_train_step(model: Model, optimizer: optax.GradientTransformation, opt_shardings):
    """(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm})."""
    loss_and_grad = jax.value_and_grad(make_loss_fn(model))

    def step(params, opt_state, batch):
        loss, grads = loss_and_grad(params, batch)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    metrics_sharding = {"loss": replicated(model.mesh), "grad_norm": replicated(model.mesh)}
    return jax.jit(
        step,
        in_shardings=(model.shardings, opt_shardings, batch_sharding(model.mesh)),
        out_shardings=(model.shardings, opt_shardings, metrics_sharding),
        donate_argnums=(0, 1),
    )


def opt_state_layout(optimizer, model: Model):
    """Shardings and shapes of the optimizer state: Adam's moments are placed
    like their parameters, counters are replicated."""
    abstract_params = model.abstract_params()
    shapes = jax.eval_shape(optimizer.init, abstract_params)
    shardings = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        shapes,
        model.shardings,
        transform_non_params=lambda _: replicated(model.mesh),
    )
    abstract = jax.tree.map(
        lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes, shardings
    )
    return shardings, abstract
