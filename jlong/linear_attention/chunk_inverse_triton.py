"""A chunk's (I + N)^-1 (`chunks.unit_lower_inverse`, N the chunk's strictly
lower system) inside a Pallas Triton kernel, for the Triton rule's chunk
terms (`chunk_terms_triton`): from N's blocks of 16 on and below the
diagonal, the diagonal blocks by doubling, as `chunks` does, then the blocks
below them by block forward substitution, X_ij = -X_ii sum_{j <= k < i} N_ik
X_kj: products of 16 x 16 blocks in float32 at full precision (IEEE on the
GPU, not TF32), about 0.4 MFLOP a chunk of 64, where XLA's doublings write
and read back [C, C] products at every step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from jlong.linear_attention.chunks import DIAGONAL_BLOCK, new_blocks


def invert_blocks(lower: dict, count: int) -> dict:
    """(I + N)^-1 of a chunk from N's blocks of DIAGONAL_BLOCK on and below the diagonal ({(i, k): block},
    float32, the diagonal blocks' diagonals and upper parts ignored), as {(i, j): block} for j <= i, inside a Triton
    kernel: the diagonal blocks by doubling, the blocks below by block forward substitution."""
    b = DIAGONAL_BLOCK
    rows = jax.lax.broadcasted_iota(jnp.int32, (b, b), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (b, b), 1)
    dot = functools.partial(plgpu.dot, precision=jax.lax.Precision.HIGHEST)
    blocks = {}  # (i, j) -> the inverse's block
    for i in range(count):
        X, size = (rows == columns).astype(jnp.float32), 1
        strictly_lower = jnp.where(columns < rows, lower[i, i], 0.0)
        while size < b:  # the diagonal block's doublings, as chunks._doublings
            X = X - dot(dot(X, jnp.where(new_blocks(rows, columns, size), strictly_lower, 0.0)), X)
            size *= 2
        blocks[i, i] = X
        for j in range(i):  # the rows above are done: X_kj for every k < i
            total = functools.reduce(jnp.add, (dot(lower[i, k], blocks[k, j]) for k in range(j, i)))
            blocks[i, j] = -dot(X, total)
    return blocks


def products_flops(chunk: int) -> float:
    """The FLOPs of one chunk's inverse: the diagonal blocks' doublings (two products each) and the
    substitution's products (the sums', then X_ii's), each 2 b^3."""
    b, count = DIAGONAL_BLOCK, chunk // DIAGONAL_BLOCK
    doublings = (b.bit_length() - 1) * 2 * count
    substitution = sum(i - j + 1 for i in range(count) for j in range(i))
    return 2.0 * b**3 * (doublings + substitution)
