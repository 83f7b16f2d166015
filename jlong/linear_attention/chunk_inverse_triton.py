"""Every chunk's (I + N)^-1 (`chunks.unit_lower_inverse`, N the chunk's
strictly lower system) as one Pallas Triton kernel, for the Triton gated
delta rule: a program per chunk reads N once and writes the inverse once,
where XLA's doublings write and read back [C, C] products at every step
(about a third of the rule's forward memory traffic at 32,768 tokens x 16
heads of 128, by the compiled program's count: experiments/kernel_estimate.py).

A program inverts its chunk's diagonal blocks of 16 by doubling, as
`chunks` does, then fills the blocks below them by block forward
substitution, X_ij = -X_ii sum_{j <= k < i} N_ik X_kj: products of 16 x 16
blocks in float32 at full precision (IEEE on the GPU, not TF32), about
0.4 MFLOP a chunk of 64. Its gradient is `chunks`' own (two batched
products in XLA). `interpret=True` runs the same kernel on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jlong.errors import JlongError
from jlong.linear_attention.chunks import DIAGONAL_BLOCK, inverse_with_its_gradient, new_blocks
from jlong.ops.pallas_calls import kernel_call

NAME = "chunk_inverse"  # the kernel's name in a compiled program
NUM_WARPS = 2  # 16 x 16 products: a warp or two each


def _kernel(system_ref, inverse_ref, *, chunk: int):
    b = DIAGONAL_BLOCK
    m, count = pl.program_id(0), chunk // b
    rows = jax.lax.broadcasted_iota(jnp.int32, (b, b), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (b, b), 1)
    dot = functools.partial(plgpu.dot, precision=jax.lax.Precision.HIGHEST)

    def block(ref, i, j):
        return ref.at[m, pl.ds(i * b, b), pl.ds(j * b, b)]

    lower = {(i, k): plgpu.load(block(system_ref, i, k)) for i in range(count) for k in range(i + 1)}
    blocks = {}  # (i, j) -> the inverse's block
    for i in range(count):
        X, size = (rows == columns).astype(jnp.float32), 1
        while size < b:  # the diagonal block's doublings, as chunks._doublings
            X = X - dot(dot(X, jnp.where(new_blocks(rows, columns, size), lower[i, i], 0.0)), X)
            size *= 2
        blocks[i, i] = X
        for j in range(i):  # the rows above are done: X_kj for every k < i
            total = functools.reduce(jnp.add, (dot(lower[i, k], blocks[k, j]) for k in range(j, i)))
            blocks[i, j] = -dot(X, total)
    for i in range(count):
        for j in range(count):
            value = blocks[i, j] if j <= i else jnp.zeros((b, b), jnp.float32)
            plgpu.store(block(inverse_ref, i, j), value)


def _invert(strictly_lower, interpret: bool):
    *batch, C, _ = strictly_lower.shape
    if C % DIAGONAL_BLOCK:
        raise JlongError(f"the Triton chunk inverse needs chunks of a multiple of {DIAGONAL_BLOCK} tokens, got {C}")
    flat = strictly_lower.reshape(-1, C, C).astype(jnp.float32)
    call = kernel_call(functools.partial(_kernel, chunk=C), jax.ShapeDtypeStruct(flat.shape, jnp.float32),
                       interpret=interpret, grid=(flat.shape[0],), name=NAME,
                       compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1))
    return call(flat).reshape(*batch, C, C)


_INVERSES = {interpret: inverse_with_its_gradient(functools.partial(_invert, interpret=interpret))
             for interpret in (False, True)}


def inverse(strictly_lower, interpret: bool = False):
    """(I + N)^-1 of strictly lower N [..., C, C] (C a multiple of 16) in float32, differentiable."""
    return _INVERSES[interpret](strictly_lower)


def products_flops(chunk: int) -> float:
    """The FLOPs of one chunk's inverse: the diagonal blocks' doublings (two products each) and the
    substitution's products (the sums', then X_ii's), each 2 b^3."""
    b, count = DIAGONAL_BLOCK, chunk // DIAGONAL_BLOCK
    doublings = (b.bit_length() - 1) * 2 * count
    substitution = sum(i - j + 1 for i in range(count) for j in range(i))
    return 2.0 * b**3 * (doublings + substitution)
