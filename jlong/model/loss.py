"""Next-token cross-entropy, from whole logits or tile by tile (`memory.loss_tile`),
as a mean (training) or per token (evaluation)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.ops.shards import HIDDEN, REPLICATED, TOKENS, OneDevice, Shards
from jlong.ops.tiling import join_tiles, split_tiles, varying_like


def output_logits(hidden_BSD, w_DV):
    """float32 logits [B, S, V] of hidden states through the output embedding."""
    return jnp.einsum("bsd,dv->bsv", hidden_BSD, w_DV, preferred_element_type=jnp.float32)


def cross_entropy(logits_BSV, targets_BS, mask_BS=None):
    """Mean over the (unmasked) target tokens, computed in float32."""
    if mask_BS is None:
        mask_BS = jnp.ones(targets_BS.shape, jnp.bool_)
    total, count = _loss_sums(logits_BSV, targets_BS, mask_BS)
    return total / jnp.maximum(count, 1.0)


def tiled_cross_entropy(hidden_BSD, w_DV, targets_BS, mask_BS=None, *, tile: int, shards: Shards = OneDevice()):
    """The same mean as `cross_entropy(hidden @ w, ...)` without the whole
    logits: each device walks its sequence shard `tile` tokens at a time, in
    the forward and in the backward pass (see `_tiled_loss_sums`)."""
    if mask_BS is None:
        mask_BS = jnp.ones(targets_BS.shape, jnp.bool_)
    per_device = functools.partial(_device_loss_sums, tile=tile, axes=shards.all_axes)
    run = shards.map(per_device, (HIDDEN, REPLICATED, TOKENS, TOKENS), REPLICATED)
    total, count = run(hidden_BSD, w_DV, targets_BS, mask_BS)
    return total / jnp.maximum(count, 1.0)


def _device_loss_sums(hidden, w_DV, targets, mask, *, tile, axes):
    sums = _tiled_loss_sums(hidden, varying_like(w_DV, hidden), targets, mask, tile)
    return jax.lax.psum(sums, axes) if axes else sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tiled_loss_sums(hidden_BsD, w_DV, targets_Bs, mask_Bs, tile):
    """(loss sum, token count) over a shard, one tile of logits at a time.

    A custom VJP rather than autodiff of the scan: the backward pass
    recomputes each tile's logits once, turns them into the logits' gradient
    directly (softmax - one-hot) and accumulates w's gradient in float32
    whatever the compute dtype.
    """

    def add_tile(sums, inputs):
        h_BTD, targets_BT, mask_BT = inputs
        tile_sums = _loss_sums(output_logits(h_BTD, w_DV), targets_BT, mask_BT)
        return jax.tree.map(jnp.add, sums, tile_sums), None

    zero = jnp.zeros_like(targets_Bs, jnp.float32, shape=())  # varies like the shard, as the sums do
    tiles = tuple(split_tiles(a, tile) for a in (hidden_BsD, targets_Bs, mask_Bs))
    sums, _ = jax.lax.scan(add_tile, (zero, zero), tiles)
    return sums


def _tiled_loss_forward(hidden, w, targets, mask, tile):
    return _tiled_loss_sums(hidden, w, targets, mask, tile), (hidden, w, targets, mask)


def _tiled_loss_backward(tile, residuals, cotangents):
    hidden_BsD, w_DV, targets_Bs, mask_Bs = residuals
    d_total = cotangents[0]  # the count does not depend on the inputs

    def tile_gradients(dw_DV, inputs):
        h_BTD, targets_BT, mask_BT = inputs
        return tile_gradient(h_BTD, w_DV, targets_BT, mask_BT.astype(jnp.float32) * d_total, dw_DV)

    tiles = tuple(split_tiles(a, tile) for a in (hidden_BsD, targets_Bs, mask_Bs))
    dw_DV, dh = jax.lax.scan(tile_gradients, jnp.zeros_like(w_DV, jnp.float32), tiles)
    return join_tiles(dh), dw_DV.astype(w_DV.dtype), None, None


def tile_gradient(h_BTD, w_DV, targets_BT, scale_BT, dw_DV):
    """A tile's part of the gradients of sum(scale x cross-entropy): (dw, with
    the tile's added in float32; dh). The tile's logits are recomputed once and
    turned into their gradient directly: (softmax - one-hot) x scale."""
    logits_BTV = output_logits(h_BTD, w_DV)
    one_hot = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
    dlogits_BTV = ((jax.nn.softmax(logits_BTV, axis=-1) - one_hot) * scale_BT[..., None]).astype(h_BTD.dtype)
    dh_BTD = jnp.einsum("btv,dv->btd", dlogits_BTV, w_DV, preferred_element_type=jnp.float32)
    dw_DV = dw_DV + jnp.einsum("btd,btv->dv", h_BTD, dlogits_BTV, preferred_element_type=jnp.float32)
    return dw_DV, dh_BTD.astype(h_BTD.dtype)


_tiled_loss_sums.defvjp(_tiled_loss_forward, _tiled_loss_backward)


def token_scores(hidden_BSD, w_DV, targets_BS, *, tile: int = 0, shards: Shards = OneDevice()):
    """[B, S, 2] float32: each token's cross-entropy and whether its target is
    the most likely token (1.0) or not (0.0), in the layout of the sequence
    given. With `tile`, a tile of logits at a time on each device."""
    if not tile:
        return _scores(output_logits(hidden_BSD, w_DV), targets_BS)
    per_device = functools.partial(_device_token_scores, tile=tile)
    # HIDDEN's trailing axis is unsharded while computing: here it holds the two scores.
    return shards.map(per_device, (HIDDEN, REPLICATED, TOKENS), HIDDEN)(hidden_BSD, w_DV, targets_BS)


def _device_token_scores(hidden_BsD, w_DV, targets_Bs, *, tile):
    w_DV = varying_like(w_DV, hidden_BsD)

    def score_tile(_, inputs):
        h_BTD, targets_BT = inputs
        return None, _scores(output_logits(h_BTD, w_DV), targets_BT)

    _, scores = jax.lax.scan(score_tile, None, (split_tiles(hidden_BsD, tile), split_tiles(targets_Bs, tile)))
    return join_tiles(scores)


def _scores(logits_BSV, targets_BS):
    logits = logits_BSV.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - target_logit
    hits = (jnp.argmax(logits, axis=-1) == targets_BS).astype(jnp.float32)
    return jnp.stack([losses, hits], axis=-1)


def _loss_sums(logits_BSV, targets_BS, mask_BS):
    """(sum of the unmasked tokens' losses, their count), float32."""
    logits = logits_BSV.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    losses = jax.nn.logsumexp(logits, axis=-1) - target_logit
    mask = mask_BS.astype(jnp.float32)
    return (losses * mask).sum(), mask.sum()


def target_logprobs(hidden_BSD, w_DV, targets_BS, *, tile: int = 0, shards: Shards = OneDevice()):
    """(log p(target) [B, S], the entropy of p [B, S]), float32, per token in
    the batch's layout, p the softmax of the logits (scale the hidden states
    to take a temperature). With `tile`, a tile of logits at a time on each
    device, forward and backward: no [S, V] logits exist. Gradients flow
    through the log-probabilities; the entropy is a measurement."""
    if not tile:
        return _logprobs_and_entropy(output_logits(hidden_BSD, w_DV), targets_BS)
    per_device = functools.partial(_device_target_logprobs, tile=tile)
    return shards.map(per_device, (HIDDEN, REPLICATED, TOKENS), (TOKENS, TOKENS))(hidden_BSD, w_DV, targets_BS)


def _logprobs_and_entropy(logits_BSV, targets_BS):
    logits = logits_BSV.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    target = jnp.take_along_axis(logprobs, targets_BS[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logprobs) * logprobs, axis=-1)
    return target, jax.lax.stop_gradient(entropy)


def _device_target_logprobs(hidden_BsD, w_DV, targets_Bs, *, tile):
    return _tiled_target_logprobs(hidden_BsD, varying_like(w_DV, hidden_BsD), targets_Bs, tile)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_target_logprobs(hidden_BsD, w_DV, targets_Bs, tile):
    """The shard's per-token log-probabilities and entropies, one tile of logits at a time. A custom VJP: the
    backward pass is the tiled cross-entropy's (`tile_gradient`), each token scaled by its cotangent, negated
    (log p = -cross-entropy)."""

    def one_tile(_, inputs):
        h_BTD, targets_BT = inputs
        return None, _logprobs_and_entropy(output_logits(h_BTD, w_DV), targets_BT)

    _, (logprobs, entropy) = jax.lax.scan(one_tile, None, (split_tiles(hidden_BsD, tile), split_tiles(targets_Bs, tile)))
    return join_tiles(logprobs), join_tiles(entropy)


def _target_logprobs_forward(hidden, w, targets, tile):
    return _tiled_target_logprobs(hidden, w, targets, tile), (hidden, w, targets)


def _target_logprobs_backward(tile, residuals, cotangents):
    hidden_BsD, w_DV, targets_Bs = residuals
    d_logprobs_Bs = cotangents[0]

    def tile_gradients(dw_DV, inputs):
        h_BTD, targets_BT, d_BT = inputs
        return tile_gradient(h_BTD, w_DV, targets_BT, -d_BT, dw_DV)

    tiles = tuple(split_tiles(a, tile) for a in (hidden_BsD, targets_Bs, d_logprobs_Bs))
    dw_DV, dh = jax.lax.scan(tile_gradients, jnp.zeros_like(w_DV, jnp.float32), tiles)
    return join_tiles(dh), dw_DV.astype(w_DV.dtype), None


_tiled_target_logprobs.defvjp(_target_logprobs_forward, _target_logprobs_backward)
