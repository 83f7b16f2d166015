"""The gated delta rule's chunk-to-chunk recurrence as Pallas Triton
kernels, one per pass (`jlong.linear_attention.chunk_recurrence` runs the
chunk-local work around them as FLA structures it, the chunk terms and their
gradient in `chunk_terms_triton`'s kernels): a program per
(sequence x head, block of value columns) walks the chunks with the state
[dk, block_v] on chip in float32, forward

    v_new = u - w S,   S <- decay S + kw^T v_new

and backward, the chunks in reverse with the state's gradient dS on chip,

    dv_new = a^T do + kw dS,   dS <- qr^T do + decay dS - w^T dv_new.

The matrices enter the kernels in bf16 when v is bf16 (as FLA's do; the
state and every accumulation stay float32), and what the kernels leave for
the outputs' and the chunk terms' gradient's kernels (the states entering
the chunks, v_new and their gradients) is stored in bf16 too, as those
read it; in float32 otherwise (the ring's summaries, the tests), whose
products run as three TF32 ones on the tensor cores (`jlong.ops.triton_dots`).
`interpret=True` runs the same kernels on the CPU. Same contract as
`gated_delta.chunked`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jlong.errors import JlongError
from jlong.linear_attention import chunk_terms_triton
from jlong.linear_attention.chunk_recurrence import BLOCK, CHUNK, rule  # noqa: F401  (the rule's sizes, named here too)
from jlong.ops.pallas_calls import kernel_call, pipeline_stages, triton_kernel_name
from jlong.ops.triton_dots import dot_for

# Value columns per program, warps and pipeline stages, from experiments/kernel_tiles.py on an H200
# (2026-11-28; experiments/results/kernel-tiles.json): 16 columns (more programs for the few heads of one
# device) and 3 stages (the next chunk's terms load while this one's products run) ran the recurrence at
# 32-33 M tokens/s forward and backward where 64 columns in 1 stage ran 10-12 M.
BLOCK_V = 16
NUM_WARPS, NUM_STAGES = 4, 3  # float32 terms (the ring's summaries) run one stage: `pipeline_stages`
FORWARD, BACKWARD, OUTPUTS = "gated_delta_forward", "gated_delta_backward", "gated_delta_outputs"  # kernels' names
OUTPUT_BLOCK_V = 64  # value columns per program of the outputs' kernel (a chunk's products are independent)


def _block_v(dv: int) -> int:
    block = min(BLOCK_V, dv)
    if dv % block or block < 16 or block & (block - 1):
        raise JlongError(f"the Triton gated delta rule needs value widths that are multiples of 16, got {dv}")
    return block


def _forward_kernel(u_ref, w_ref, kw_ref, decay_ref, state_ref, final_ref, states_ref, v_new_ref, *, chunks: int,
                    block_v: int):
    bh, columns = pl.program_id(0), pl.ds(pl.program_id(1) * block_v, block_v)
    operand = w_ref.dtype
    dot = dot_for(operand)

    def one_chunk(c, S):
        load = lambda ref, *index: plgpu.load(ref.at[bh, c, *index])  # noqa: E731
        plgpu.store(states_ref.at[bh, c, :, columns], S.astype(operand))
        v_new = load(u_ref, slice(None), columns).astype(jnp.float32) - dot(load(w_ref), S.astype(operand))
        plgpu.store(v_new_ref.at[bh, c, :, columns], v_new.astype(operand))
        return S * plgpu.load(decay_ref.at[bh, c]) + dot(load(kw_ref), v_new.astype(operand), trans_a=True)

    state = plgpu.load(state_ref.at[bh, :, columns])
    plgpu.store(final_ref.at[bh, :, columns], jax.lax.fori_loop(0, chunks, one_chunk, state))


def _backward_kernel(do_ref, w_ref, a_ref, qr_ref, kw_ref, decay_ref, d_final_ref, d_v_new_ref, d_next_ref,
                     d_state_ref, *, chunks: int, block_v: int):
    bh, columns = pl.program_id(0), pl.ds(pl.program_id(1) * block_v, block_v)
    operand = w_ref.dtype
    dot = dot_for(operand)

    def one_chunk(i, dS):
        c = chunks - 1 - i
        load = lambda ref, *index: plgpu.load(ref.at[bh, c, *index])  # noqa: E731
        plgpu.store(d_next_ref.at[bh, c, :, columns], dS.astype(operand))  # the gradient of the state it leaves
        do = load(do_ref, slice(None), columns)
        d_v_new = dot(load(a_ref), do, trans_a=True) + dot(load(kw_ref), dS.astype(operand))
        plgpu.store(d_v_new_ref.at[bh, c, :, columns], d_v_new.astype(operand))
        return (dot(load(qr_ref), do, trans_a=True) + dS * plgpu.load(decay_ref.at[bh, c])
                - dot(load(w_ref), d_v_new.astype(operand), trans_a=True))

    d_final = plgpu.load(d_final_ref.at[bh, :, columns])
    plgpu.store(d_state_ref.at[bh, :, columns], jax.lax.fori_loop(0, chunks, one_chunk, d_final))


def _outputs_kernel(qr_ref, a_ref, states_ref, v_new_ref, o_ref, *, block_v: int):
    bh, c, columns = pl.program_id(0), pl.program_id(1), pl.ds(pl.program_id(2) * block_v, block_v)
    dot = dot_for(qr_ref.dtype)
    load = lambda ref, *index: plgpu.load(ref.at[bh, c, *index])  # noqa: E731
    o = dot(load(qr_ref), load(states_ref, slice(None), columns)) + dot(load(a_ref), load(v_new_ref, slice(None),
                                                                                                  columns))
    plgpu.store(o_ref.at[bh, c, :, columns], o.astype(o_ref.dtype))


def _call(kernel, name: str, out_shapes, grid, interpret: bool, operand):
    """`out_shapes`: (shape, dtype) of each result."""
    return kernel_call(
        kernel,
        tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in out_shapes),
        interpret=interpret,
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=pipeline_stages(NUM_STAGES, operand)),
        name=name,
    )


def _forward(u, w, kw, decay, state, interpret):
    """The final state [BH, dk, dv] in float32, the state entering each chunk
    [BH, n, dk, dv] and v_new [BH, n, C, dv] in the terms' dtype (what the
    kernels after it read them in)."""
    (BH, n, C, dv), dk = u.shape, w.shape[-1]
    block_v = _block_v(dv)
    kernel = functools.partial(_forward_kernel, chunks=n, block_v=block_v)
    shapes = [((BH, dk, dv), jnp.float32), ((BH, n, dk, dv), w.dtype), ((BH, n, C, dv), w.dtype)]
    return _call(kernel, FORWARD, shapes, (BH, dv // block_v), interpret, w.dtype)(u, w, kw, decay, state)


def _backward(do, d_final, w, a, qr, kw, decay, interpret):
    """dv_new [BH, n, C, dv] and the gradient of the state each chunk leaves
    [BH, n, dk, dv] in the terms' dtype, and of the initial state [BH, dk, dv]
    in float32."""
    (BH, n, C, dv), dk = do.shape, w.shape[-1]
    block_v = _block_v(dv)
    kernel = functools.partial(_backward_kernel, chunks=n, block_v=block_v)
    shapes = [((BH, n, C, dv), w.dtype), ((BH, n, dk, dv), w.dtype), ((BH, dk, dv), jnp.float32)]
    return _call(kernel, BACKWARD, shapes, (BH, dv // block_v), interpret, w.dtype)(do, w, a, qr, kw, decay,
                                                                                     d_final)


def _outputs_block_v(dv: int) -> int:
    """The outputs' kernel's value columns a program: up to OUTPUT_BLOCK_V, a power of two dividing dv."""
    _block_v(dv)  # multiples of 16 only, as the recurrence's
    return math.gcd(dv, OUTPUT_BLOCK_V)


def _outputs(qr, a, states, v_new, interpret):
    """o = qr S + a v_new [BH, n, C, dv] in the terms' dtype: a program per chunk and block of value
    columns, its two products summed in float32 on chip (where XLA wrote each in float32 and read both
    back to add and round them)."""
    (BH, n, C, _), dv = qr.shape, v_new.shape[-1]
    block_v = _outputs_block_v(dv)
    kernel = functools.partial(_outputs_kernel, block_v=block_v)
    return _call(kernel, OUTPUTS, [((BH, n, C, dv), qr.dtype)], (BH, n, dv // block_v), interpret,
                 qr.dtype)(qr, a, states, v_new)[0]


triton = rule(_forward, _backward, _outputs, chunk_terms_triton.forward, chunk_terms_triton.backward)
# The recurrence kernels alone, XLA's batched products around them: what the H200 race of b6e22e7 ran.
triton_recurrence = rule(_forward, _backward)


def call_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> float | None:
    """The FLOPs of one of these kernels' calls in a compiled program, for the
    planner: per chunk and value column, the forward's two products
    (w S, kw^T v_new) 4 C dk, the backward's four 2 C (3 dk + C); None for
    any other call."""
    name = triton_kernel_name(target, attributes)
    if name not in (FORWARD, BACKWARD):
        return None
    BH, n, C, dv = operand_dims[0]
    dk = operand_dims[1][-1]  # w [BH, n, C, dk], the second operand of both
    per_column = 4 * C * dk if name == FORWARD else 2 * C * (3 * dk + C)
    return float(BH * n * dv * per_column)


def outputs_call_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> float | None:
    """The outputs' kernel's FLOPs, its two products 2 C (dk + C) per chunk and value column, for the
    planner to price as the GEMMs XLA ran them as before (not yet raced); None for any other call."""
    if triton_kernel_name(target, attributes) != OUTPUTS:
        return None
    (BH, n, C, dk), dv = operand_dims[0], operand_dims[3][-1]  # qr [BH, n, C, dk], v_new [BH, n, C, dv]
    return float(BH * n * dv * 2 * C * (dk + C))
