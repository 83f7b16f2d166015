"""The gated delta rule's chunk-to-chunk recurrence as Pallas Mosaic GPU
kernels for Hopper (TMA copies into shared memory, wgmma into float32
accumulators): the route that stays when Pallas' Triton backend is removed.
The same two passes as `gated_delta_triton`'s, one program per (sequence x
head, block of value columns), the chunks walked in order with the state on
chip and the next chunks' terms loading while this one's products run:

    forward:  v_new = u - w S,   S <- decay S + kw^T v_new
    backward: dv_new = a^T do + kw dS,   dS <- qr^T do + decay dS - w^T dv_new

The state and its gradient are carried from chunk to chunk in registers in
float32, each chunk's products summed in fresh wgmma accumulators; what a
product reads of them, the state entering a chunk and v_new (their
gradients backward), is written in bf16 to shared-memory blocks that TMA
then stores: the rows the batched XLA products after the kernels read.
Terms are 16-bit (bf16 when v is); key widths of 64 or 128, value widths
multiples of 64, chunks of 64. Float32 terms (the ring's summaries) run the same two passes
as scans over the chunks in XLA.

`interpret=True` runs the kernels in Mosaic GPU's interpreter on the CPU.
jax 0.10's interpreter cannot read a transposed shared-memory operand in
wgmma, so interpreted, the operands read transposed (kw forward; a, qr and
w backward) are transposed in memory beforehand by XLA: the same kernel
bodies, the transposition done by XLA instead of wgmma's operand layout,
whose GPU layouts are checked by compiling them (deviceless, for H100s).
The interpreter also calls back to the host, which the model's checkpoints
refuse: a model runs this rule on GPUs only (`gated_delta.GPU_ONLY_IN_MODELS`).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jlong.errors import JlongError
from jlong.linear_attention.chunk_recurrence import rule
from jlong.ops.pallas_calls import mosaic_kernel_call, mosaic_smem_layout

MOSAIC_CALL = "mosaic_gpu_v2"  # the custom call XLA:GPU runs a Mosaic GPU kernel as
# The kernels' names, which XLA keeps in each call's op_name (a Mosaic GPU call's backend config is the
# compiled kernel).
FORWARD, BACKWARD = "gated_delta_mosaic_forward", "gated_delta_mosaic_backward"
BLOCK_V = 64  # value columns per program: 128 bytes of bf16, the widest swizzle
STAGES = 2  # chunks whose terms are in flight


def _check(C: int, dk: int, dv: int) -> None:
    """Chunks of 64, a key width of 64 or 128 (the backward's blocks fill an H100's shared memory at 128),
    value widths in blocks of 64."""
    if C != 64 or dk not in (64, 128) or dv % BLOCK_V:
        raise JlongError(f"the Mosaic GPU gated delta rule needs chunks of 64, key widths of 64 or 128 and value "
                         f"widths that are multiples of 64, got chunks of {C}, widths {dk} and {dv}: set "
                         "kernels.gated_delta=chunked")


def _kernel(body, name: str, out_type, grid, interpret: bool):
    body.__name__ = name  # what the call's op_name says
    return mosaic_kernel_call(
        body, out_type, interpret=interpret, grid=grid, grid_names=("bh", "column"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def _rows(x):
    """[BH, n, R, X] -> [BH n R, X]: a chunk's block is block row bh n + c."""
    return x.reshape(-1, x.shape[-1])


def _spec(rows: int, columns: int, dtype, column_of, chunk_row):
    """A chunk's block of rows x columns: block row `chunk_row(i)` at pipeline step i, block column
    `column_of()`."""
    return plgpu.BlockSpec((rows, columns), lambda i: (chunk_row(i), column_of()),
                           transforms=mosaic_smem_layout(columns, dtype))


def _load_state(state_gmem, bh, columns, shape):
    """state_gmem[bh, :, columns] (float32), on chip."""
    def load(smem, barrier):
        plgpu.copy_gmem_to_smem(state_gmem.at[bh, :, columns], smem, barrier)
        plgpu.barrier_wait(barrier)
        state = smem[...]
        plgpu.commit_smem()  # its barrier: every warp has read smem before the pipeline's copies reuse it
        return state

    return pl.run_scoped(load, plgpu.SMEM(shape, jnp.float32), plgpu.Barrier())


def _store_state(state, out_gmem, bh, columns):
    def store(smem):
        smem[...] = state
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_gmem.at[bh, :, columns])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(store, plgpu.SMEM(state.shape, jnp.float32))


def _block_smem(rows: int, dtype):
    """A chunk's block of rows x BLOCK_V value columns in shared memory, laid out for wgmma and TMA."""
    return plgpu.SMEM((rows, BLOCK_V), dtype, transforms=mosaic_smem_layout(BLOCK_V, dtype))


def _store_block(smem, out_gmem, block_row, columns, rows: int):
    """A chunk's block to its rows of out_gmem [BH n rows, dv] (TMA, not waited for)."""
    plgpu.copy_smem_to_gmem(smem, out_gmem.at[pl.ds(block_row * rows, rows), columns])


def _products(shape, *operands):
    """The sum of a @ b over the (a, b) pairs of shared-memory refs, in a fresh float32 accumulator."""
    def run(acc_ref):
        for a, b in zip(operands[::2], operands[1::2]):
            plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]  # waits for the products

    return pl.run_scoped(run, plgpu.ACC(shape))


def forward(u, w, kw, decay, state, interpret: bool):
    """The final state [BH, dk, dv] float32, the state entering each chunk
    [BH, n, dk, dv] and v_new [BH, n, C, dv] in the terms' dtype: u [BH, n,
    C, dv], w and kw [BH, n, C, dk], decay [BH, n], state [BH, dk, dv]."""
    if w.dtype == jnp.float32:
        return _forward_scan(u, w, kw, decay, state)
    (BH, n, C, dv), dk, dtype = u.shape, w.shape[-1], w.dtype
    _check(C, dk, dv)
    kw_transposed = interpret  # the interpreter reads no transposed operand: kw^T [dk, C] a chunk instead
    kw_operand = _rows(jnp.swapaxes(kw, 2, 3)) if kw_transposed else _rows(kw)

    def body(u_gmem, w_gmem, kw_gmem, decay_gmem, state_gmem, final_gmem, states_gmem, v_new_gmem):
        bh, column = lax.axis_index("bh"), lax.axis_index("column")
        columns = pl.ds(column * BLOCK_V, BLOCK_V)
        row = lambda i: bh * n + i  # noqa: E731
        same = lambda: 0  # noqa: E731
        mine = lambda: column  # noqa: E731

        def run(states_smem, v_new_smem):
            def step(index, u_smem, w_smem, kw_smem, S):
                c = index[0]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's rows have left
                states_smem[...] = S.astype(dtype)  # the state entering chunk c
                plgpu.commit_smem()
                _store_block(states_smem, states_gmem, row(c), columns, dk)
                v_new = u_smem[...].astype(jnp.float32) - _products((C, BLOCK_V), w_smem, states_smem)
                v_new_smem[...] = v_new.astype(dtype)
                plgpu.commit_smem()
                _store_block(v_new_smem, v_new_gmem, row(c), columns, C)
                kw_t = kw_smem if kw_transposed else kw_smem.transpose((1, 0))
                return S * decay_gmem[bh, c] + _products((dk, BLOCK_V), kw_t, v_new_smem)

            final = plgpu.emit_pipeline(
                step,
                grid=(n,),
                in_specs=[_spec(C, BLOCK_V, dtype, mine, row), _spec(C, dk, dtype, same, row),
                          _spec(dk, C, dtype, same, row) if kw_transposed else _spec(C, dk, dtype, same, row)],
                max_concurrent_steps=STAGES,
                init_carry=_load_state(state_gmem, bh, columns, (dk, BLOCK_V)),
            )(u_gmem, w_gmem, kw_gmem)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            _store_state(final, final_gmem, bh, columns)

        pl.run_scoped(run, _block_smem(dk, dtype), _block_smem(C, dtype))

    out_type = (jax.ShapeDtypeStruct((BH, dk, dv), jnp.float32), jax.ShapeDtypeStruct((BH * n * dk, dv), dtype),
                jax.ShapeDtypeStruct((BH * n * C, dv), dtype))
    final, states, v_new = _kernel(body, FORWARD, out_type, (BH, dv // BLOCK_V), interpret)(
        _rows(u), _rows(w), kw_operand, decay, state)
    return final, states.reshape(BH, n, dk, dv), v_new.reshape(BH, n, C, dv)


def backward(do, d_final, w, a, qr, kw, decay, interpret: bool):
    """dv_new [BH, n, C, dv] and the gradient of the state each chunk leaves
    [BH, n, dk, dv] in the terms' dtype, and of the initial state [BH, dk,
    dv] in float32: the chunks walked from the last."""
    if w.dtype == jnp.float32:
        return _backward_scan(do, d_final, w, a, qr, kw, decay)
    (BH, n, C, dv), dk, dtype = do.shape, w.shape[-1], w.dtype
    _check(C, dk, dv)
    transposed = interpret  # a^T, qr^T and w^T in memory for the interpreter
    t = (lambda x: _rows(jnp.swapaxes(x, 2, 3))) if transposed else _rows  # noqa: E731
    read_t = (lambda ref: ref) if transposed else (lambda ref: ref.transpose((1, 0)))  # noqa: E731

    def body(do_gmem, w_gmem, a_gmem, qr_gmem, kw_gmem, decay_gmem, d_final_gmem, d_v_new_gmem, d_next_gmem,
             d_state_gmem):
        bh, column = lax.axis_index("bh"), lax.axis_index("column")
        columns = pl.ds(column * BLOCK_V, BLOCK_V)
        row = lambda i: bh * n + n - 1 - i  # noqa: E731  (the last chunk first)
        same = lambda: 0  # noqa: E731
        mine = lambda: column  # noqa: E731
        transposed_spec = lambda: _spec(dk, C, dtype, same, row) if transposed else _spec(C, dk, dtype, same, row)  # noqa: E731

        def run(d_next_smem, d_v_new_smem, negated_smem):
            def step(index, do_smem, w_smem, a_smem, qr_smem, kw_smem, dS):
                c = n - 1 - index[0]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last chunk's rows have left
                d_next_smem[...] = dS.astype(dtype)  # the gradient of the state chunk c leaves
                plgpu.commit_smem()
                _store_block(d_next_smem, d_next_gmem, bh * n + c, columns, dk)
                d_v_new = _products((C, BLOCK_V), read_t(a_smem), do_smem, kw_smem, d_next_smem)
                d_v_new_smem[...] = d_v_new.astype(dtype)
                negated_smem[...] = (-d_v_new).astype(dtype)  # wgmma adds: w^T (-dv_new)
                plgpu.commit_smem()
                _store_block(d_v_new_smem, d_v_new_gmem, bh * n + c, columns, C)
                return dS * decay_gmem[bh, c] + _products((dk, BLOCK_V), read_t(qr_smem), do_smem,
                                                          read_t(w_smem), negated_smem)

            d_state = plgpu.emit_pipeline(
                step,
                grid=(n,),
                in_specs=[_spec(C, BLOCK_V, dtype, mine, row), transposed_spec(),
                          _spec(C, C, dtype, same, row), transposed_spec(), _spec(C, dk, dtype, same, row)],
                max_concurrent_steps=STAGES,
                init_carry=_load_state(d_final_gmem, bh, columns, (dk, BLOCK_V)),
            )(do_gmem, w_gmem, a_gmem, qr_gmem, kw_gmem)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            _store_state(d_state, d_state_gmem, bh, columns)

        pl.run_scoped(run, _block_smem(dk, dtype), _block_smem(C, dtype), _block_smem(C, dtype))

    out_type = (jax.ShapeDtypeStruct((BH * n * C, dv), dtype), jax.ShapeDtypeStruct((BH * n * dk, dv), dtype),
                jax.ShapeDtypeStruct((BH, dk, dv), jnp.float32))
    d_v_new, d_next, d_state = _kernel(body, BACKWARD, out_type, (BH, dv // BLOCK_V), interpret)(
        _rows(do), t(w), t(a), t(qr), _rows(kw), decay, d_final)
    return d_v_new.reshape(BH, n, C, dv), d_next.reshape(BH, n, dk, dv), d_state


def _by_chunk(x):
    return jnp.moveaxis(x, 1, 0)  # [BH, n, ...] -> [n, BH, ...]: scanned over the chunks


def _forward_scan(u, w, kw, decay, state):
    """`forward` on float32 terms, as a scan over the chunks in XLA (highest precision)."""
    mm = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)

    def one_chunk(S, xs):
        u_c, w_c, kw_c, decay_c = xs
        v_new = u_c - mm(w_c, S)
        return S * decay_c[:, None, None] + mm(jnp.swapaxes(kw_c, 1, 2), v_new), (S, v_new)

    final, (states, v_new) = lax.scan(one_chunk, state, tuple(map(_by_chunk, (u, w, kw, decay))))
    return final, jnp.moveaxis(states, 0, 1), jnp.moveaxis(v_new, 0, 1)


def _backward_scan(do, d_final, w, a, qr, kw, decay):
    """`backward` on float32 terms, as a scan over the chunks from the last in XLA (highest precision)."""
    mm = functools.partial(jnp.matmul, precision=lax.Precision.HIGHEST)
    t = functools.partial(jnp.swapaxes, axis1=1, axis2=2)

    def one_chunk(dS, xs):
        do_c, w_c, a_c, qr_c, kw_c, decay_c = xs
        d_v_new = mm(t(a_c), do_c) + mm(kw_c, dS)
        return dS * decay_c[:, None, None] + mm(t(qr_c), do_c) - mm(t(w_c), d_v_new), (d_v_new, dS)

    d_state, (d_v_new, d_next) = lax.scan(one_chunk, d_final, tuple(map(_by_chunk, (do, w, a, qr, kw, decay))),
                                          reverse=True)
    return jnp.moveaxis(d_v_new, 0, 1), jnp.moveaxis(d_next, 0, 1), d_state


mosaic = rule(forward, backward)


def call_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> float | None:
    """The FLOPs of one of these kernels' calls in a compiled program, for the
    planner: per chunk of C tokens and value column, the forward's two
    products 4 C dk, the backward's four 2 C (3 dk + C); None for any other
    call. Both calls' first operand holds a row per token and value column
    block ([BH n C, dv]), their second w ([BH n C, dk])."""
    names = re.findall(r'op_name="[^"]*/(' + FORWARD + "|" + BACKWARD + r')/', attributes or "")
    if target != MOSAIC_CALL or not names:
        return None
    (rows, dv), dk = operand_dims[0], operand_dims[1][-1]
    C = 64
    return float(rows * dv * (4 * dk if names[-1] == FORWARD else 2 * (3 * dk + C)))
