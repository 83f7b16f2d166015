"""Per-document sums of a packed batch: what the objectives that score whole
completions read from the model (`jlong.objectives`).

Each target token that belongs to a document carries its document's slot in
its row (DPO's `pair_documents`: 2p for pair p's chosen completion, 2p + 1
for its rejected one; GRPO's `documents`: the completion's order in the row;
-1 for every other token). `document_logps` sums log p(target) per slot:
[B, N] for N slots per row, exact on any layout (the sequence shards' partial
sums are added across ring and sp). With `memory.loss_tile`, each device
walks its shard a tile of logits at a time, forward and backward, as the
language-modelling loss does; the backward pass takes one cotangent per
document. `slot_sums` sums any per-token values so.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.model.loss import output_logits, tile_gradient
from jlong.ops.shards import HIDDEN, REPLICATED, TOKENS, OneDevice, Shards
from jlong.ops.tiling import split_tiles, join_tiles, varying_like

DOCUMENTS: tuple[str, ...] = ("batch", "documents")  # [B, N] per-document values, batch-sharded


def document_logps(hidden_BSD, w_DV, targets_BS, documents_BS, *, count: int, tile: int = 0,
                   shards: Shards = OneDevice()):
    """[B, count] float32: per row and document slot, the sum of log p(target)
    over the targets whose slot (`documents_BS`) it is; -1 belongs to none."""
    if not tile:
        return slot_sums(_target_logps(output_logits(hidden_BSD, w_DV), targets_BS), documents_BS, count)
    sequence_axes = tuple(a for a in ("ring", "sp") if a in shards.all_axes)  # size 1 too: the types say so
    per_device = functools.partial(_device_document_logps, tile=tile, count=count, axes=sequence_axes)
    return shards.map(per_device, (HIDDEN, REPLICATED, TOKENS, TOKENS), DOCUMENTS)(
        hidden_BSD, w_DV, targets_BS, documents_BS)


def _target_logps(logits_BSV, targets_BS):
    logits = logits_BSV.astype(jnp.float32)
    target_logit = jnp.take_along_axis(logits, targets_BS[..., None], axis=-1)[..., 0]
    return target_logit - jax.nn.logsumexp(logits, axis=-1)


def slot_sums(values_BS, documents_BS, count: int):
    """[B, count] sums of values by slot (a one-hot contraction: no scatter)."""
    one_hot = documents_BS[..., None] == jnp.arange(count, dtype=documents_BS.dtype)
    return jnp.einsum("bs,bsn->bn", values_BS, one_hot.astype(jnp.float32))


def _device_document_logps(hidden, w_DV, targets, documents, *, tile, count, axes):
    sums = _tiled_slot_logps(hidden, varying_like(w_DV, hidden), targets, documents, tile, count)
    return jax.lax.psum(sums, axes) if axes else sums


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _tiled_slot_logps(hidden_BsD, w_DV, targets_Bs, documents_Bs, tile, count):
    """The shard's [B, count] sums, one tile of logits at a time. A custom VJP:
    the backward pass is the tiled cross-entropy's (`loss.tile_gradient`), each
    token's scale the cotangent of its slot, negated (log p = -cross-entropy)."""

    def add_tile(sums, inputs):
        h_BTD, targets_BT, documents_BT = inputs
        return sums + slot_sums(_target_logps(output_logits(h_BTD, w_DV), targets_BT), documents_BT, count), None

    zero = jnp.zeros_like(targets_Bs, jnp.float32, shape=(targets_Bs.shape[0], count))
    tiles = tuple(split_tiles(a, tile) for a in (hidden_BsD, targets_Bs, documents_Bs))
    sums, _ = jax.lax.scan(add_tile, zero, tiles)
    return sums


def _tiled_forward(hidden, w, targets, documents, tile, count):
    return _tiled_slot_logps(hidden, w, targets, documents, tile, count), (hidden, w, targets, documents)


def _tiled_backward(tile, count, residuals, d_sums_BN):
    hidden_BsD, w_DV, targets_Bs, documents_Bs = residuals

    def tile_gradients(dw_DV, inputs):  # log p = -cross-entropy: the cross-entropy's gradient, scaled by -d
        h_BTD, targets_BT, documents_BT = inputs
        slot = jnp.maximum(documents_BT, 0)
        scale_BT = jnp.where(documents_BT >= 0, -jnp.take_along_axis(d_sums_BN, slot, axis=1), 0.0)
        return tile_gradient(h_BTD, w_DV, targets_BT, scale_BT, dw_DV)

    tiles = tuple(split_tiles(a, tile) for a in (hidden_BsD, targets_Bs, documents_Bs))
    dw_DV, dh = jax.lax.scan(tile_gradients, jnp.zeros_like(w_DV, jnp.float32), tiles)
    return join_tiles(dh), dw_DV.astype(w_DV.dtype), None, None


_tiled_slot_logps.defvjp(_tiled_forward, _tiled_backward)
