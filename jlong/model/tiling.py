"""Sequence tiles: cut a device's [B, s, ...] shard into tiles of T tokens.

Used by the tiled MLP and the tiled loss: a `lax.scan` over the tiles with a
checkpointed body holds one tile's intermediates at a time, in the forward
and in the backward pass.
"""

from __future__ import annotations

import functools

import jax


def split_tiles(x, tile: int):
    """[B, s, ...] -> [s/T, B, T, ...] (a bitcast when B = 1)."""
    B, s = x.shape[:2]
    return x.reshape(B, s // tile, tile, *x.shape[2:]).swapaxes(0, 1)


def join_tiles(x):
    """[n, B, T, ...] -> [B, n*T, ...], the inverse of `split_tiles`."""
    n, B, T = x.shape[:3]
    return x.swapaxes(0, 1).reshape(B, n * T, *x.shape[3:])


def map_tiles(fn, params, x, tile: int):
    """fn(params, x_tile) for each sequence tile of x [B, s, ...], joined back.

    The body is checkpointed with nothing saved: the backward pass recomputes
    one tile's intermediates at a time from the tile's input.
    """

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_tile(carry, x_tile):
        return carry, fn(params, x_tile)

    _, y = jax.lax.scan(one_tile, None, split_tiles(x, tile))
    return join_tiles(y)
