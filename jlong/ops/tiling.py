"""Sequence tiles: cut a device's [B, s, ...] shard into tiles of T tokens.

Used by the tiled MLP and final norm (`map_tiles`), the attention's normed
input projections (`jlong.attention.projection`) and the tiled loss: one
tile's intermediates exist at a time, in the forward and in the backward pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.ops.shards import HIDDEN, REPLICATED


def split_tiles(x, tile: int):
    """[B, s, ...] -> [s/T, B, T, ...] (a bitcast when B = 1)."""
    B, s = x.shape[:2]
    return x.reshape(B, s // tile, tile, *x.shape[2:]).swapaxes(0, 1)


def join_tiles(x):
    """[n, B, T, ...] -> [B, n*T, ...], the inverse of `split_tiles`."""
    n, B, T = x.shape[:3]
    return x.swapaxes(0, 1).reshape(B, n * T, *x.shape[3:])


def map_tiles(fn, params, x_BsD, tile: int):
    """fn(params, x_tile) for each sequence tile of x [B, s, D], where fn keeps
    the tile's shape and dtype (a norm, a residual block).

    Each tile's output overwrites the tile in place, in the forward pass and
    in the backward pass, where the gradient of a tile replaces the incoming
    gradient of that tile: no [B, s, D] buffer is made besides the input and
    its gradient (autodiff of a scan would stack its outputs in a new one and
    zero-fill it first). The backward pass recomputes one tile at a time and
    sums the parameters' gradients in float32.
    """
    return _tiles_in_place(fn, tile, varying_like(params, x_BsD), x_BsD)


def varying_like(params, x):
    """Inside shard_map the parameters are the same on every device, their
    gradients are not: marked varying like x, the custom backward passes may
    return this device's part, and the transpose of the mark sums the parts."""
    axes = set(jax.typeof(x).manual_axis_type.varying)

    def mark(p):  # over the axes p does not already vary over
        missing = tuple(sorted(axes - set(jax.typeof(p).manual_axis_type.varying)))
        return jax.lax.pcast(p, missing, to="varying") if missing else p

    return jax.tree.map(mark, params) if axes else params


def float32_zeros(params):
    return jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)


def add_in_float32(total, gradient):
    return total + gradient.astype(jnp.float32)


def cast_like(gradients, params):
    return jax.tree.map(lambda g, p: g.astype(p.dtype), gradients, params)


def tile_at(x, i, tile):
    return jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1)


def put_tile(x, tile_value, i, tile):
    return jax.lax.dynamic_update_slice_in_dim(x, tile_value, i * tile, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiles_in_place(fn, tile, params, x):
    def one_tile(i, y):
        return put_tile(y, fn(params, tile_at(y, i, tile)), i, tile)

    return jax.lax.fori_loop(0, x.shape[1] // tile, one_tile, x)


def _tiles_forward(fn, tile, params, x):
    return _tiles_in_place(fn, tile, params, x), (params, x)


def _tiles_backward(fn, tile, residuals, dy):
    params, x = residuals

    def one_tile(i, carry):
        dx, dparams = carry
        _, pullback = jax.vjp(fn, params, tile_at(x, i, tile))
        dparams_tile, dx_tile = pullback(tile_at(dx, i, tile))
        dparams = jax.tree.map(add_in_float32, dparams, dparams_tile)
        return put_tile(dx, dx_tile, i, tile), dparams

    dx, dparams = jax.lax.fori_loop(0, x.shape[1] // tile, one_tile, (dy, float32_zeros(params)))
    return cast_like(dparams, params), dx


_tiles_in_place.defvjp(_tiles_forward, _tiles_backward)


def per_sequence_tile(fn, params, x_BSD, *, shards, tile: int):
    """fn(params, x) on the whole array (`tile` 0), or on each device's shard
    of x [B, S, D] tile by tile (`map_tiles`); fn keeps x's shape."""
    if not tile:
        return fn(params, x_BSD)
    per_device = functools.partial(map_tiles, fn, tile=tile)
    return shards.map(per_device, (REPLICATED, HIDDEN), HIDDEN)(params, x_BSD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def tiles_gradient_into(fn, tile, params, x, tokens, sink):
    """(fn(params, x_tile, tokens_tile) for each sequence tile, joined along
    the sequence; `sink` unchanged), where x's gradient goes into the sink's.

    The backward pass recomputes one tile at a time and adds the tile's part
    of x's gradient into the sink's gradient in place; x itself gets none.
    `tokens` (per-token integers: positions) gets no gradient.
    """

    def one_tile(_, tiles):
        return None, fn(params, *tiles)

    _, outputs = jax.lax.scan(one_tile, None, (split_tiles(x, tile), split_tiles(tokens, tile)))
    return jax.tree.map(join_tiles, outputs), sink


def _gradient_into_forward(fn, tile, params, x, tokens, sink):
    return tiles_gradient_into(fn, tile, params, x, tokens, sink), (params, x, tokens)


def _gradient_into_backward(fn, tile, saved, cotangents):
    params, x, tokens = saved
    d_outputs, d_sink = cotangents

    def one_tile(i, carry):
        d_sink, dparams = carry
        tokens_tile = tile_at(tokens, i, tile)
        _, pullback = jax.vjp(lambda p, x_tile: fn(p, x_tile, tokens_tile), params, tile_at(x, i, tile))
        dparams_tile, dx_tile = pullback(jax.tree.map(lambda d: tile_at(d, i, tile), d_outputs))
        dparams = jax.tree.map(add_in_float32, dparams, dparams_tile)
        return put_tile(d_sink, tile_at(d_sink, i, tile) + dx_tile, i, tile), dparams

    d_sink, dparams = jax.lax.fori_loop(0, x.shape[1] // tile, one_tile, (d_sink, float32_zeros(params)))
    return cast_like(dparams, params), None, None, d_sink


tiles_gradient_into.defvjp(_gradient_into_forward, _gradient_into_backward)
