"""Grouped matmuls as Pallas Mosaic GPU kernels for Hopper (TMA copies into
shared memory, wgmma into a float32 accumulator): the route that stays when
Pallas' Triton backend is removed. Operands are 16-bit (bf16 or f16), as
wgmma reads them from shared memory in either orientation.

The work is cut as the Triton kernels cut it (`jlong.moe.row_tiles`):

- the products (forward, and the input gradient by the weights transposed):
  one program per (row tile, group) pair that overlaps and block of output
  columns, the contraction pipelined through shared memory. A tile's rows
  of other groups are multiplied and never stored: TMA stores a fixed
  number of rows, so a group's part of a tile is stored in pieces of 2^i
  rows, one piece per set bit of its row count;
- the weight gradient: one program per group and output block, the
  contraction running over the group's row tiles, rows of other groups set
  to zero in shared memory (the first and last tile of a group).

`interpret=True` runs the kernels in Mosaic GPU's interpreter on the CPU.
jax 0.10's interpreter cannot read a transposed shared-memory operand in
wgmma, so interpreted, the two kernels that read one (the input gradient's
weights, the weight gradient's rows) are handed that operand transposed in
memory beforehand and read it as it lies: the same kernel bodies, the
transposition done by XLA instead of by wgmma's operand layout. So the CPU
tests check the kernels' tiling, pipelines, masks and stores, and the
transposed layouts the GPU reads are checked only by compiling them
(deviceless, for H100s) until a GPU runs them (experiments/kernel_race.py
compares every pass with a float32 reference).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlong.errors import JlongError
from jlong.moe.row_tiles import differentiable, group_bounds, padded_to, tile_width, work_items
from jlong.ops.pallas_calls import mosaic_kernel_call, mosaic_smem_layout

MOSAIC_CALL = "mosaic_gpu_v2"  # the custom call XLA:GPU runs a Mosaic GPU kernel as
# The kernels' names, which XLA keeps in each call's op_name (a Mosaic GPU call's backend config is the
# compiled kernel), and which operand of each call is its rows [M, K].
PRODUCT, WEIGHT_GRADIENT = "grouped_matmul_mosaic", "grouped_matmul_mosaic_weight_gradient"
ROWS_OPERAND = {PRODUCT: 5, WEIGHT_GRADIENT: 2}
# Tiles and pipeline depth. Not yet raced on a GPU: wgmma's natural 128 x 128 accumulator for one
# warpgroup, 64 of the contraction a step (128 bytes of bf16: the widest swizzle), four steps in flight.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES = 128, 128, 64, 4
WGRAD_BLOCK_M = 64  # rows a step of the weight gradient's contraction
OPERAND_DTYPES = (jnp.bfloat16, jnp.float16)


def _width(size: int, cap: int) -> int:
    return tile_width(size, cap, 64, "Mosaic GPU")  # 64: wgmma's and TMA's smallest here


def _kernel(body, name: str, out_type, grid, names, interpret: bool):
    body.__name__ = name  # what the call's op_name says
    return mosaic_kernel_call(
        body, out_type, interpret=interpret, grid=grid, grid_names=names,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _store_rows(o_smem, o_gmem, first, count, row0, column_slice, block_m):
    """Rows [first, first + count) of the tile in shared memory to rows row0 + first... of o_gmem:
    one TMA store of 2^i rows for each bit i set in count."""
    offset = first
    piece = block_m
    while piece:
        @pl.when(count & piece != 0)
        def _(offset=offset, piece=piece):
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset, piece)], o_gmem.at[pl.ds(row0 + offset, piece), column_slice])

        offset = offset + (count & piece)
        piece //= 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _product(x_MK, w, group_sizes_G, *, transpose_w: bool, interpret: bool):
    """x [M, K] by w [G, K, N] (transpose_w: by w [G, N, K] transposed), M a whole number of tiles."""
    M, K = x_MK.shape
    if transpose_w and interpret:  # the interpreter reads no transposed operand: transpose it here
        w, transpose_w = jnp.swapaxes(w, 1, 2), False
    N = w.shape[1] if transpose_w else w.shape[2]
    block_n, block_k = _width(N, BLOCK_N), _width(K, BLOCK_K)
    starts, ends = group_bounds(group_sizes_G)
    group, tile, real = work_items(starts, ends, M, BLOCK_M)
    x_layout = mosaic_smem_layout(block_k, x_MK.dtype)
    w_layout = x_layout if transpose_w else mosaic_smem_layout(block_n, w.dtype)
    w_block = (block_n, block_k) if transpose_w else (block_k, block_n)

    def body(group_ref, tile_ref, real_ref, start_ref, end_ref, x_gmem, w_gmem, o_gmem):
        item, column = lax.axis_index("item"), lax.axis_index("column")

        @pl.when(item < real_ref[0])
        def _():
            g, t = group_ref[item], tile_ref[item]

            def step(_, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)) if transpose_w else w_smem)

            def accumulate(acc_ref):
                plgpu.emit_pipeline(
                    functools.partial(_with_acc, step, acc_ref),
                    grid=(K // block_k,),
                    in_specs=[
                        plgpu.BlockSpec((BLOCK_M, block_k), lambda k: (t, k), transforms=x_layout, delay_release=1),
                        plgpu.BlockSpec(w_block, (lambda k: (column, k)) if transpose_w else (lambda k: (k, column)),
                                        transforms=w_layout, delay_release=1),
                    ],
                    max_concurrent_steps=STAGES,
                )(x_gmem, w_gmem.at[g])
                return acc_ref[...]

            total = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_M, block_n)))

            def store(o_smem):
                o_smem[...] = total.astype(o_smem.dtype)
                plgpu.commit_smem()
                first = jnp.maximum(start_ref[g], t * BLOCK_M)
                count = jnp.minimum(end_ref[g], (t + 1) * BLOCK_M) - first
                _store_rows(o_smem, o_gmem, first - t * BLOCK_M, count, t * BLOCK_M,
                            pl.ds(column * block_n, block_n), BLOCK_M)

            pl.run_scoped(store, plgpu.SMEM((BLOCK_M, block_n), x_MK.dtype))

    return _kernel(body, PRODUCT, jax.ShapeDtypeStruct((M, N), x_MK.dtype), (group.shape[0], N // block_n),
                   ("item", "column"), interpret)(group, tile, real[None], starts, ends, x_MK, w)


def _with_acc(step, acc_ref, index, *smem):
    return step(index, *smem, acc_ref)


def _weight_gradient(x_MK, dy_MN, group_sizes_G, dtype, *, interpret: bool):
    """[G, K, N]: each group's rows of x, transposed, times its rows of dy (M a whole number of tiles)."""
    (M, K), (_, N), G = x_MK.shape, dy_MN.shape, group_sizes_G.shape[0]
    block_n, block_k = _width(N, BLOCK_N), _width(K, BLOCK_N)
    rows_transposed = interpret  # the interpreter reads no transposed operand: x^T [K, M] instead
    x_operand = x_MK.T if rows_transposed else x_MK
    starts, ends = group_bounds(group_sizes_G)
    x_layout = mosaic_smem_layout(WGRAD_BLOCK_M if rows_transposed else block_k, x_MK.dtype)
    x_block = (block_k, WGRAD_BLOCK_M) if rows_transposed else (WGRAD_BLOCK_M, block_k)
    row_axis = 1 if rows_transposed else 0

    def body(start_ref, end_ref, x_gmem, dy_gmem, dw_gmem):
        g, k_block, column = lax.axis_index("group"), lax.axis_index("k"), lax.axis_index("column")
        start, end = start_ref[g], end_ref[g]
        first_tile = start // WGRAD_BLOCK_M
        tiles = jnp.where(end > start, (end - 1) // WGRAD_BLOCK_M - first_tile + 1, 0)

        def step(index, x_smem, dy_smem, acc_ref):
            row0 = (first_tile + index[0]) * WGRAD_BLOCK_M

            @pl.when((row0 < start) | (row0 + WGRAD_BLOCK_M > end))
            def _():  # a tile shared with other groups: their rows contribute zero
                rows = row0 + lax.broadcasted_iota(jnp.int32, x_block, row_axis)
                x_smem[...] = jnp.where((rows >= start) & (rows < end), x_smem[...], 0).astype(x_smem.dtype)
                plgpu.commit_smem()

            plgpu.wgmma(acc_ref, x_smem if rows_transposed else x_smem.transpose((1, 0)), dy_smem)

        def accumulate(acc_ref):
            x_index = (lambda i: (k_block, first_tile + i)) if rows_transposed else (lambda i: (first_tile + i, k_block))
            plgpu.emit_pipeline(
                functools.partial(_with_acc, step, acc_ref),
                grid=(tiles,),
                in_specs=[
                    plgpu.BlockSpec(x_block, x_index, transforms=x_layout, delay_release=1),
                    plgpu.BlockSpec((WGRAD_BLOCK_M, block_n), lambda i: (first_tile + i, column),
                                    transforms=mosaic_smem_layout(block_n, dy_MN.dtype), delay_release=1),
                ],
                max_concurrent_steps=STAGES,
            )(x_gmem, dy_gmem)
            return acc_ref[...]

        total = pl.run_scoped(accumulate, plgpu.ACC((block_k, block_n)))

        def store(dw_smem):
            dw_smem[...] = total.astype(dw_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dw_smem, dw_gmem.at[g, pl.ds(k_block * block_k, block_k),
                                                         pl.ds(column * block_n, block_n)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(store, plgpu.SMEM((block_k, block_n), dtype))

    return _kernel(body, WEIGHT_GRADIENT, jax.ShapeDtypeStruct((G, K, N), dtype), (G, K // block_k, N // block_n),
                   ("group", "k", "column"), interpret)(starts, ends, x_operand, dy_MN)


_grouped = differentiable(_product, _weight_gradient)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, interpret: bool = False):
    """Rows [M, K] by their groups' matrices [G, K, N] (group sizes [G] summing to M), differentiable;
    bf16 or f16 operands of one dtype, K and N multiples of 64."""
    if x_MK.dtype != w_GKN.dtype or not any(x_MK.dtype == d for d in OPERAND_DTYPES):
        raise JlongError(f"the Mosaic GPU grouped matmul takes bf16 or f16 operands of one dtype, got "
                         f"{x_MK.dtype} and {w_GKN.dtype}: compute in bf16 or set kernels.grouped_matmul=triton")
    tile = math.lcm(BLOCK_M, WGRAD_BLOCK_M)  # whole tiles of either kernel
    return _grouped(padded_to(x_MK, tile), w_GKN, group_sizes_G, interpret)[:x_MK.shape[0]]


def call_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> float | None:
    """The FLOPs of one of these kernels' calls in a compiled program (its
    custom-call target, attributes as the HLO text prints them, operand and
    result shapes), for the planner: 2 x rows x K x N of the rows it is
    given; None for any other call. The kernel is known by its name in the
    call's op_name, where jax's Mosaic GPU lowering puts its body's name (a
    named scope jax may drop one day: test_grouped_matmul_mosaic compiles a
    step and checks the names are there)."""
    names = re.findall(r'op_name="[^"]*/(' + PRODUCT + r'(?:_weight_gradient)?)/', attributes or "")
    if target != MOSAIC_CALL or not names:
        return None
    rows, contracted = operand_dims[ROWS_OPERAND[names[-1]]]
    return 2.0 * rows * contracted * result_dims[-1]
