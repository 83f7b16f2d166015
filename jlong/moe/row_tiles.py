"""What the GPU grouped matmuls share, whatever their backend: rows sorted
by group cut into tiles, the (tile, group) work items that overlap, rows
padded to whole tiles, tile widths that divide a matrix's, and the custom
gradient that runs a kernel's products and weight gradient."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.errors import JlongError


def group_bounds(group_sizes_G):
    """(starts, ends) [G] int32: each group's first row and the row after its last."""
    ends = jnp.cumsum(group_sizes_G).astype(jnp.int32)
    return ends - group_sizes_G.astype(jnp.int32), ends


def work_items(starts_G, ends_G, rows: int, block_m: int):
    """(group, tile) of each work item [W] int32, and how many are real: the
    (tile, group) pairs whose rows overlap, in order, for groups of rows
    [starts, ends) (`group_bounds`); W = rows / block_m + G - 1."""
    G = starts_G.shape[0]
    first_tile = starts_G // block_m
    tiles = jnp.where(ends_G > starts_G, (ends_G - 1) // block_m - first_tile + 1, 0)
    item_ends = jnp.cumsum(tiles)
    W = rows // block_m + G - 1
    item = jnp.arange(W, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(item_ends, item, side="right"), G - 1).astype(jnp.int32)
    tile = (first_tile[group] + item - (item_ends[group] - tiles[group])).astype(jnp.int32)
    return group, tile, item_ends[-1].astype(jnp.int32)


def tile_width(size: int, cap: int, smallest: int, kernel: str) -> int:
    """The largest power of two up to `cap` that divides `size`, at least
    `smallest` (the backend's smallest product tile); a one-line error naming
    the kernel where none divides it."""
    width = cap
    while width > smallest and size % width:
        width //= 2
    if size % width:
        raise JlongError(f"the {kernel} grouped matmul needs matrix widths that are multiples of {smallest}, "
                         f"got {size}")
    return width


def differentiable(product, weight_gradient):
    """A grouped matmul (x [M, K], w [G, K, N], group sizes [G], interpret) ->
    [M, N] from a backend's kernels: `product(x, w, sizes, transpose_w=...,
    interpret=...)` for the forward and the input's gradient (by w
    transposed), `weight_gradient(x, dy, sizes, dtype, interpret=...)` for
    the weights'. M must be whole tiles of both kernels (`padded_to`)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
    def grouped(x_MK, w_GKN, group_sizes_G, interpret):
        return product(x_MK, w_GKN, group_sizes_G, transpose_w=False, interpret=interpret)

    def forward(x_MK, w_GKN, group_sizes_G, interpret):
        return grouped(x_MK, w_GKN, group_sizes_G, interpret), (x_MK, w_GKN, group_sizes_G)

    def backward(interpret, saved, dy_MN):
        x_MK, w_GKN, group_sizes_G = saved
        dx = product(dy_MN, w_GKN, group_sizes_G, transpose_w=True, interpret=interpret)
        dw = weight_gradient(x_MK, dy_MN, group_sizes_G, w_GKN.dtype, interpret=interpret)
        return dx, dw, None

    grouped.defvjp(forward, backward)
    return grouped


def padded_to(x_MK, tile: int):
    """x with zero rows added up to a whole number of `tile` rows (padding rows belong to no group)."""
    M = x_MK.shape[0]
    rows = -(-M // tile) * tile
    return x_MK if rows == M else jnp.pad(x_MK, ((0, rows - M), (0, 0)))
