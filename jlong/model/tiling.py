"""Sequence tiles: cut a device's [B, s, ...] shard into tiles of T tokens.

Used by the tiled MLP and final norm (`map_tiles`), the attention's normed
input projections (`map_tiles_gradient_into`) and the tiled loss: one tile's
intermediates exist at a time, in the forward and in the backward pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


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
    return _tiles_in_place(fn, tile, _varying_like(params, x_BsD), x_BsD)


def _varying_like(params, x):
    """Inside shard_map the parameters are the same on every device, their
    gradients are not: marked varying like x, the custom backward passes may
    return this device's part, and the transpose of the mark sums the parts."""
    if axes := tuple(sorted(jax.typeof(x).manual_axis_type.varying)):
        return jax.tree.map(lambda p: jax.lax.pcast(p, axes, to="varying"), params)
    return params


def _float32_zeros(params):
    return jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params)


def _add_in_float32(total, gradient):
    return total + gradient.astype(jnp.float32)


def _cast_like(gradients, params):
    return jax.tree.map(lambda g, p: g.astype(p.dtype), gradients, params)


def _tile_at(x, i, tile):
    return jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1)


def _put_tile(x, tile_value, i, tile):
    return jax.lax.dynamic_update_slice_in_dim(x, tile_value, i * tile, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiles_in_place(fn, tile, params, x):
    def one_tile(i, y):
        return _put_tile(y, fn(params, _tile_at(y, i, tile)), i, tile)

    return jax.lax.fori_loop(0, x.shape[1] // tile, one_tile, x)


def _tiles_forward(fn, tile, params, x):
    return _tiles_in_place(fn, tile, params, x), (params, x)


def _tiles_backward(fn, tile, residuals, dy):
    params, x = residuals

    def one_tile(i, carry):
        dx, dparams = carry
        _, pullback = jax.vjp(fn, params, _tile_at(x, i, tile))
        dparams_tile, dx_tile = pullback(_tile_at(dx, i, tile))
        dparams = jax.tree.map(_add_in_float32, dparams, dparams_tile)
        return _put_tile(dx, dx_tile, i, tile), dparams

    dx, dparams = jax.lax.fori_loop(0, x.shape[1] // tile, one_tile, (dy, _float32_zeros(params)))
    return _cast_like(dparams, params), dx


_tiles_in_place.defvjp(_tiles_forward, _tiles_backward)


def map_tiles_gradient_into(fn, params, x_BsD, tokens_Bs, sink_BsD, tile: int):
    """(fn(params, x_tile, tokens_tile) for each sequence tile, joined along
    the sequence; `sink` unchanged), where x's gradient goes into the sink's.

    The backward pass recomputes one tile at a time and adds the tile's part
    of x's gradient into the sink's gradient in place; x itself gets none. A
    caller that applies fn to the same x several times (the attention's
    stages) passes one sink along through all of them: their gradients add up
    in one buffer, the sink's, and reach x through the sink's own start value.
    `tokens` (per-token integers, e.g. positions) gets no gradient.
    """
    return _tiles_gradient_into(fn, tile, _varying_like(params, x_BsD), x_BsD, tokens_Bs, sink_BsD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiles_gradient_into(fn, tile, params, x, tokens, sink):
    def one_tile(_, tiles):
        return None, fn(params, *tiles)

    _, outputs = jax.lax.scan(one_tile, None, (split_tiles(x, tile), split_tiles(tokens, tile)))
    return jax.tree.map(join_tiles, outputs), sink


def _gradient_into_forward(fn, tile, params, x, tokens, sink):
    return _tiles_gradient_into(fn, tile, params, x, tokens, sink), (params, x, tokens)


def _gradient_into_backward(fn, tile, saved, cotangents):
    params, x, tokens = saved
    d_outputs, d_sink = cotangents

    def one_tile(i, carry):
        d_sink, dparams = carry
        tokens_tile = _tile_at(tokens, i, tile)
        _, pullback = jax.vjp(lambda p, x_tile: fn(p, x_tile, tokens_tile), params, _tile_at(x, i, tile))
        dparams_tile, dx_tile = pullback(jax.tree.map(lambda d: _tile_at(d, i, tile), d_outputs))
        dparams = jax.tree.map(_add_in_float32, dparams, dparams_tile)
        return _put_tile(d_sink, _tile_at(d_sink, i, tile) + dx_tile, i, tile), dparams

    d_sink, dparams = jax.lax.fori_loop(0, x.shape[1] // tile, one_tile, (d_sink, _float32_zeros(params)))
    return _cast_like(dparams, params), None, None, d_sink


_tiles_gradient_into.defvjp(_gradient_into_forward, _gradient_into_backward)
