"""Grouped matmuls as Pallas Triton kernels (GPU; `interpret=True` runs them
anywhere, as the tests do): FLOPs for the rows each group has, never a
product with every group's matrix.

The rows [M, K], sorted by group, are cut into tiles of `block_m` rows. A
tile that holds rows of several groups is run once per group, storing only
that group's rows, so the work items are the (tile, group) pairs that
overlap: at most M / block_m + G - 1 of them, a static bound. The grid runs
one program per work item and block of output columns; a program past the
last real item does nothing.

- `grouped_matmul(x, w, sizes)`: x [M, K] by w [G, K, N] -> [M, N], each
  row by its group's matrix (`transpose_w`: by w [G, N, K] transposed);
- the gradient of w is each group's rows transposed times theirs of the
  output's gradient, [G, K, N]: one program per group and output block,
  looping over that group's row tiles.

Float32 operands multiply as three TF32 products (`jlong.ops.triton_dots`,
about float32's accuracy; Triton's own would be one TF32 product).

Executed FLOPs are at most (M + (G - 1) x block_m) x K x N x 2 per product,
against 2 M K N for the rows themselves: with M = 32,768 routed rows and 128
experts, 1.25x at block_m = 64; with 65,536 rows, 1.25x at 128.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jlong.moe.row_tiles import differentiable, group_bounds, padded_to, tile_width, work_items
from jlong.ops.pallas_calls import kernel_call, pipeline_stages, triton_kernel_name
from jlong.ops.triton_dots import dot_for

PRODUCT, WEIGHT_GRADIENT = "grouped_matmul", "grouped_matmul_weight_gradient"  # the kernels' names
ROWS_OPERAND = {PRODUCT: 5, WEIGHT_GRADIENT: 2}  # which operand of each kernel's call is its rows [M, K]
# Tiles, warps and pipeline stages, the products' (forward and input gradient) apart from the weight
# gradient's, from experiments/kernel_tiles.py on an H200 (2026-11-28; experiments/results/kernel-tiles.json):
# 128 x 256 with 8 warps ran the products at 241-270 TFLOP/s where 64 x 128 ran 136-202, but its weight
# gradient needs more shared memory than a Hopper SM has; 64 x 128 with 8 warps and 4 stages ran it best
# (193). The two not yet raced together.
BLOCK_M = 128  # rows per tile
BLOCK_N = 256  # output columns per program, at most
BLOCK_K = 64  # the contraction's step, at most
NUM_WARPS, NUM_STAGES = 8, 4
WGRAD_BLOCK_M, WGRAD_BLOCK_N, WGRAD_BLOCK_K = 64, 128, 64
WGRAD_NUM_WARPS, WGRAD_NUM_STAGES = 8, 4  # float32 operands run one stage: `pipeline_stages`


def _width(size: int, cap: int) -> int:
    return tile_width(size, cap, 16, "Triton")  # 16: Triton's smallest dot


def _product_kernel(group_ref, tile_ref, real_ref, start_ref, end_ref, x_ref, w_ref, out_ref, *,
                    block_m, block_n, block_k, transpose_w):
    item, column_block = pl.program_id(0), pl.program_id(1)

    @pl.when(item < real_ref[0])
    def _():
        group, tile = group_ref[item], tile_ref[item]
        rows = tile * block_m + jnp.arange(block_m)
        in_group = (rows >= start_ref[group]) & (rows < end_ref[group])
        row_slice = pl.ds(tile * block_m, block_m)
        column_slice = pl.ds(column_block * block_n, block_n)
        K = x_ref.shape[1]

        def step(k, total):
            # The tile's rows of other groups are multiplied too and never stored: unmasked loads
            # (the rows are padded to whole tiles, so every load is in bounds).
            k_slice = pl.ds(k * block_k, block_k)
            x = plgpu.load(x_ref.at[row_slice, k_slice])
            if transpose_w:
                w = plgpu.load(w_ref.at[group, column_slice, k_slice]).T
            else:
                w = plgpu.load(w_ref.at[group, k_slice, column_slice])
            return total + dot_for(x.dtype)(x, w)

        total = jax.lax.fori_loop(0, K // block_k, step, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(out_ref.at[row_slice, column_slice], total.astype(out_ref.dtype), mask=in_group[:, None])


def _product(x_MK, w, group_sizes_G, *, transpose_w: bool, interpret: bool):
    M, K = x_MK.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    block_n, block_k = _width(N, BLOCK_N), _width(K, BLOCK_K)
    start, end = group_bounds(group_sizes_G)
    group, tile, real = work_items(start, end, M, BLOCK_M)
    kernel = functools.partial(_product_kernel, block_m=BLOCK_M, block_n=block_n, block_k=block_k,
                               transpose_w=transpose_w)
    return kernel_call(
        kernel,
        jax.ShapeDtypeStruct((M, N), x_MK.dtype),
        interpret=interpret,
        grid=(group.shape[0], N // block_n),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=pipeline_stages(NUM_STAGES, x_MK.dtype)),
        name=PRODUCT,
    )(group, tile, real[None], start, end, x_MK, w)


def _weight_gradient_kernel(start_ref, end_ref, x_ref, dy_ref, dw_ref, *, block_m, block_n, block_k):
    group, k_block, column_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[group], end_ref[group]
    k_slice, column_slice = pl.ds(k_block * block_k, block_k), pl.ds(column_block * block_n, block_n)
    first = start // block_m
    tiles = jnp.where(end > start, (end - 1) // block_m - first + 1, 0)

    def step(i, total):
        tile = first + i
        rows = tile * block_m + jnp.arange(block_m)
        in_group = ((rows >= start) & (rows < end))[:, None]
        row_slice = pl.ds(tile * block_m, block_m)
        x = plgpu.load(x_ref.at[row_slice, k_slice], mask=in_group, other=0.0)  # zero rows: other groups' add 0
        dy = plgpu.load(dy_ref.at[row_slice, column_slice])
        return total + dot_for(x.dtype)(x.T, dy)

    total = jax.lax.fori_loop(0, tiles, step, jnp.zeros((block_k, block_n), jnp.float32))
    plgpu.store(dw_ref.at[group, k_slice, column_slice], total.astype(dw_ref.dtype))


def _weight_gradient(x_MK, dy_MN, group_sizes_G, dtype, *, interpret: bool):
    """[G, K, N]: each group's rows of x, transposed, times its rows of dy."""
    (_, K), (_, N), G = x_MK.shape, dy_MN.shape, group_sizes_G.shape[0]
    block_n, block_k = _width(N, WGRAD_BLOCK_N), _width(K, WGRAD_BLOCK_K)
    start, end = group_bounds(group_sizes_G)
    kernel = functools.partial(_weight_gradient_kernel, block_m=WGRAD_BLOCK_M, block_n=block_n, block_k=block_k)
    return kernel_call(
        kernel,
        jax.ShapeDtypeStruct((G, K, N), dtype),
        interpret=interpret,
        grid=(G, K // block_k, N // block_n),
        compiler_params=plgpu.CompilerParams(num_warps=WGRAD_NUM_WARPS,
                                             num_stages=pipeline_stages(WGRAD_NUM_STAGES, x_MK.dtype)),
        name=WEIGHT_GRADIENT,
    )(start, end, x_MK, dy_MN)


_grouped = differentiable(_product, _weight_gradient)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, interpret: bool = False):
    """Rows [M, K] by their groups' matrices [G, K, N] (group sizes [G] summing to M), differentiable."""
    tile = math.lcm(BLOCK_M, WGRAD_BLOCK_M)  # whole tiles of either kernel: no load past the rows
    return _grouped(padded_to(x_MK, tile), w_GKN, group_sizes_G, interpret)[:x_MK.shape[0]]


def call_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> float | None:
    """The FLOPs of one of these kernels' calls in a compiled program (its
    custom-call target, attributes as the HLO text prints them, operand and
    result shapes), for the planner: 2 x rows x K x N of the rows it is
    given (the routed rows, not the masked work of shared tiles); None for
    any other call."""
    name = triton_kernel_name(target, attributes)
    if name not in ROWS_OPERAND:
        return None
    rows, contracted = operand_dims[ROWS_OPERAND[name]]
    return 2.0 * rows * contracted * result_dims[-1]
