"""Every chunk's terms (`chunks.chunk_terms`: the WY / UT representation,
attention inside the chunk, the decays) and their gradient as Pallas Triton
kernels, one per pass, for the Triton gated delta rule, as FLA structures
its chunk-local work: a program per (sequence x value head, chunk) reads the
chunk's tokens once and writes its terms once (forward), or reads the
tokens, the chunk's inverse saved by the forward and what the recurrence
saved and its backward kernel gave once, takes the terms' gradients from
those and writes the tokens' gradients once (backward), where XLA's batched
products and autodiff through them wrote and read back every intermediate
([C, C] decays, systems, products and their gradients in float32): most of
the rule's memory traffic (experiments/kernel_estimate.py).

With X = (I + N)^-1, N = P D strictly below the diagonal, P = (beta k) k^T,
D the decays inside a document, e_r = exp(cum g) where a token reads the
incoming state and e_w = exp(cum_last - cum g) where it writes the outgoing
one, the terms are

    u = X (beta v),  w = X (beta k e_r),  a = (q k^T) D,  qr = q e_r,
    kw = k e_w,      decay = exp(cum_last) (no document starts inside).

The forward runs in blocks of 16 rows and 64 columns (Triton cannot slice a
value), X by `chunk_inverse_triton`; the backward runs the chain rule back
to q, k, v, g and beta, the inverse's own gradient dN = -X^T dX X^T on its
strictly lower part. The products over the key and value widths are loops
(`fori_loop`), not unrolled: Triton's compile time grows with products times
operations in a kernel, and a loop's body is compiled once whatever the
width. The products take the terms' operand dtype (bf16 when v is, as FLA's
kernels do) with float32 sums; float32 ones (the ring's summaries) run as
three TF32 products (`jlong.ops.triton_dots`), as do the inverse's gradient's
two [C, C] products in every dtype. The forward's inverse keeps IEEE float32
products of 16 x 16 blocks (scalar FMAs on the GPU; `float32_flops` tells the
planner): it is unrolled, and as three TF32 products it took the whole
rule's bf16 compile from 7 to 32 s. `interpret=True` runs the same kernels
on the CPU.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jlong.errors import JlongError
from jlong.linear_attention.chunk_inverse_triton import invert_blocks, products_flops
from jlong.linear_attention.chunks import DIAGONAL_BLOCK, ChunkTerms
from jlong.ops.pallas_calls import kernel_call, triton_kernel_name
from jlong.ops.triton_dots import dot_for, float32_dot

FORWARD_NAME, BACKWARD_NAME = "chunk_terms_forward", "chunk_terms_backward"  # the kernels' names in a program
FORWARD_NUM_WARPS = 4  # products of 16-row blocks
BACKWARD_NUM_WARPS = 8  # [C, C] and [C, BLOCK] float32 tiles: eight warps hold more of them in registers
# Columns of q, k, v and the terms a step of the kernels' loops takes: the products over the key and value
# widths run a block at a time (the ring's float32 values of dk + dv = 256 whole would not fit an H100's
# shared memory, and Triton loads power-of-two shapes only).
BLOCK = 64


def _block(dk: int, dv: int) -> int:
    """Columns a step of the kernels' loops takes: up to BLOCK, a power of two dividing both widths (at least
    16, Triton's smallest product)."""
    block = math.gcd(dk, dv, BLOCK)
    if block < 16:
        raise JlongError(f"the Triton chunk terms need head widths that are multiples of 16, got {dk} and {dv}")
    return block


def _check_chunk(chunk: int):
    if chunk < DIAGONAL_BLOCK or chunk & (chunk - 1):
        raise JlongError(f"the Triton chunk terms need chunks of a power of two tokens, {DIAGONAL_BLOCK} or more, "
                         f"got {chunk}")


def _chunk_ends(g, seg, prev, chunk: int):
    """(the log decay over the chunk, the segment of the token before it, its last token's segment) from
    its g, segment ids and their predecessors' [C], as chunk_terms reads them."""
    index = jnp.arange(chunk)
    return jnp.sum(g), jnp.sum(jnp.where(index == 0, prev, 0)), jnp.sum(jnp.where(index == chunk - 1, seg, 0))


def _forward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, prev_ref, u_ref, w_ref, a_ref, qr_ref,
                    kw_ref, decay_ref, inverse_ref, *, chunk: int, heads: int, group: int, block: int):
    """A chunk's terms and its inverse, a block of DIAGONAL_BLOCK rows and `block` columns at a time
    (Triton cannot slice a value, and loads only power-of-two shapes, so each block is loaded on its own;
    the blocks of one chunk stay in the L2 cache)."""
    bh, c = pl.program_id(0), pl.program_id(1)
    b, h = bh // heads, bh % heads
    size, count = DIAGONAL_BLOCK, chunk // DIAGONAL_BLOCK
    operand = q_ref.dtype
    dot = dot_for(operand)
    load = plgpu.load
    index = jnp.arange(chunk)
    g = load(g_ref.at[b, pl.ds(c * chunk, chunk), h])
    seg, prev = (load(ref.at[b, pl.ds(c * chunk, chunk)]) for ref in (seg_ref, prev_ref))
    cum_last, before, last = _chunk_ends(g, seg, prev, chunk)
    plgpu.store(decay_ref.at[b, h, c], jnp.exp(cum_last) * (last == before))
    key_blocks, value_blocks = k_ref.shape[-1] // block, v_ref.shape[-1] // block

    # Each block of rows' decays and masks, as chunk_terms computes them.
    cum, seg_of, e_r, e_w, beta = {}, {}, {}, {}, {}
    for i in range(count):
        position = i * size + jnp.arange(size)
        cum[i] = jnp.sum(jnp.where(index[None, :] <= position[:, None], g[None, :], 0.0), axis=1)
        seg_of[i] = load(seg_ref.at[b, pl.ds(c * chunk + i * size, size)])
        e_r[i] = jnp.exp(cum[i]) * (seg_of[i] == before)
        e_w[i] = jnp.exp(cum_last - cum[i]) * (seg_of[i] == last)
        beta[i] = load(beta_ref.at[b, pl.ds(c * chunk + i * size, size), h])

    def tokens(ref, head, i, j):  # a token ref's rows of block i, columns of block j
        return load(ref.at[b, pl.ds(c * chunk + i * size, size), head, pl.ds(j * block, block)])

    def term(ref, i, j, width):  # a term's rows of block i, columns of block j (of `width`)
        return ref.at[b, h, c, pl.ds(i * size, size), pl.ds(j * width, width)]

    def key_side(i, j):  # q, k, beta k and beta k e_r (w = X kg) on rows i, key columns j
        q, k = tokens(q_ref, h // group, i, j), tokens(k_ref, h // group, i, j)
        kb = (k * beta[i][:, None]).astype(operand)
        return q, k, kb, (kb * e_r[i][:, None]).astype(operand)

    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    zero = jnp.zeros((size, size), jnp.float32)
    lower = {}  # N's blocks on and below the diagonal (the diagonal blocks' own diagonals ignored)
    for i in range(count):
        def scaled_keys(j, carry, i=i):  # q e_r and k e_w on rows i, key columns j
            q, k = tokens(q_ref, h // group, i, j), tokens(k_ref, h // group, i, j)
            plgpu.store(term(qr_ref, i, j, block), (q * e_r[i][:, None]).astype(operand))
            plgpu.store(term(kw_ref, i, j, block), (k * e_w[i][:, None]).astype(operand))
            return carry

        jax.lax.fori_loop(0, key_blocks, scaled_keys, 0)
        for m in range(count):
            if m > i:
                plgpu.store(term(a_ref, i, m, size), zero.astype(operand))
                continue
            same = seg_of[i][:, None] == seg_of[m][None, :]  # D's block (i, m): within a document, causal
            if m == i:
                same &= columns <= rows
            D = jnp.where(same, jnp.exp(jnp.where(same, cum[i][:, None] - cum[m][None, :], 0.0)), 0.0)

            def key_products(j, sums, i=i, m=m):  # kb k^T and q k^T of rows i and m over key columns j
                P, QK = sums
                q, _, kb, _ = key_side(i, j)
                k = tokens(k_ref, h // group, m, j)
                return P + dot(kb, k, trans_b=True), QK + dot(q, k, trans_b=True)

            P, QK = jax.lax.fori_loop(0, key_blocks, key_products, (zero, zero))
            lower[i, m] = P * D
            plgpu.store(term(a_ref, i, m, size), (QK * D).astype(operand))
    X = invert_blocks(lower, count)
    for i in range(count):
        for m in range(count):
            plgpu.store(term(inverse_ref, i, m, size), X[i, m] if m <= i else zero)
        Xo = [X[i, m].astype(operand) for m in range(i + 1)]

        def u_columns(j, carry, i=i, Xo=Xo):  # u = X (beta v) on rows i, value columns j
            vb = [(tokens(v_ref, h, m, j) * beta[m][:, None]).astype(operand) for m in range(i + 1)]
            u = functools.reduce(jnp.add, (dot(Xo[m], vb[m]) for m in range(i + 1)))
            plgpu.store(term(u_ref, i, j, block), u.astype(operand))
            return carry

        def w_columns(j, carry, i=i, Xo=Xo):  # w = X (beta k e_r) on rows i, key columns j
            w = functools.reduce(jnp.add, (dot(Xo[m], key_side(m, j)[3]) for m in range(i + 1)))
            plgpu.store(term(w_ref, i, j, block), w.astype(operand))
            return carry

        jax.lax.fori_loop(0, value_blocks, u_columns, 0)
        jax.lax.fori_loop(0, key_blocks, w_columns, 0)


def forward(q, k, v, g, beta, seg, prev, *, chunk: int, interpret: bool):
    """`chunks.chunk_terms_and_inverse` of q, k [B, T, Hk, dk], v [B, T, H, dv] in the terms' operand dtype,
    g, beta [B, T, H] float32, seg, prev [B, T] (T whole chunks): the `ChunkTerms` [B, H, n, C, ...] in the
    operand dtype (the decays float32) and the inverses [B, H, n, C, C] float32."""
    B, T, H, dv = v.shape
    dk, n, operand = k.shape[-1], T // chunk, v.dtype
    _check_chunk(chunk)
    shapes = [((B, H, n, chunk, dv), operand), ((B, H, n, chunk, dk), operand), ((B, H, n, chunk, chunk), operand),
              ((B, H, n, chunk, dk), operand), ((B, H, n, chunk, dk), operand), ((B, H, n), jnp.float32),
              ((B, H, n, chunk, chunk), jnp.float32)]
    *terms, inverse = kernel_call(
        functools.partial(_forward_kernel, chunk=chunk, heads=H, group=H // k.shape[2], block=_block(dk, dv)),
        tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
        interpret=interpret,
        grid=(B * H, n),
        compiler_params=plgpu.CompilerParams(num_warps=FORWARD_NUM_WARPS, num_stages=1),
        name=FORWARD_NAME,
    )(q, k, v, g, beta, seg, prev)
    return ChunkTerms(*terms), inverse


def _backward_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, seg_ref, prev_ref, inverse_ref, do_ref, dv_new_ref,
                     states_ref, v_new_ref, d_next_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, chunk: int,
                     heads: int, group: int, block: int):
    bh, c = pl.program_id(0), pl.program_id(1)
    b, h = bh // heads, bh % heads
    tokens = pl.ds(c * chunk, chunk)
    operand = q_ref.dtype
    dot = dot_for(operand)
    inverse_dot = float32_dot  # the inverse's gradient's [C, C] products, float32 in every dtype
    load = plgpu.load

    def columns_of(ref, head, j):  # a token ref's block j of `block` columns in this chunk
        return ref.at[b, tokens, head, pl.ds(j * block, block)]

    def chunk_columns(ref, j):  # the recurrence's [C, dv] block j of value columns
        return load(ref.at[b, h, c, :, pl.ds(j * block, block)])

    def state_block(ref, i, j):  # a [dk, dv] state's (or its gradient's) block of key rows i, value columns j
        return load(ref.at[b, h, c, pl.ds(i * block, block), pl.ds(j * block, block)])

    g, beta = (load(ref.at[b, tokens, h]) for ref in (g_ref, beta_ref))
    seg, prev = load(seg_ref.at[b, tokens]), load(prev_ref.at[b, tokens])
    X = load(inverse_ref.at[b, h, c])

    # The chunk's decays and masks, as chunk_terms computes them.
    index = jnp.arange(chunk)
    rows = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    causal = cols <= rows
    cum = jnp.sum(jnp.where(causal, g[None, :], 0.0), axis=1)  # the log decay from the chunk's start
    cum_last, before, last = _chunk_ends(g, seg, prev, chunk)
    same = causal & (seg[:, None] == seg[None, :])
    D = jnp.where(same, jnp.exp(jnp.where(same, cum[:, None] - cum[None, :], 0.0)), 0.0)
    e_r = jnp.exp(cum) * (seg == before)
    e_w = jnp.exp(cum_last - cum) * (seg == last)
    decay = jnp.exp(cum_last) * (last == before)
    Xo = X.astype(operand)  # X entered u's and w's products in the operand dtype

    def key_side(j):  # block j of the key columns: q, k, beta k, and beta k e_r (w = X kg)
        q, k = (load(columns_of(ref, h // group, j)) for ref in (q_ref, k_ref))
        kb = (k * beta[:, None]).astype(operand)
        return q, k, kb, (kb * e_r[:, None]).astype(operand)

    key_blocks, value_blocks = k_ref.shape[-1] // block, v_ref.shape[-1] // block

    def terms_gradients(j, only_w: bool):
        """The recurrence's gradients of w, qr and kw on key columns block j (v_new = u - w S, o = qr S +
        a v_new, S' = decay S + kw^T v_new), and its share of decay's: sums over the value columns."""
        def step(i, sums):
            dw, dqr, dkw, d_decay = sums
            S = state_block(states_ref, j, i)
            dw -= dot(chunk_columns(dv_new_ref, i), S, trans_b=True)
            if not only_w:
                dS = state_block(d_next_ref, j, i)
                dqr += dot(chunk_columns(do_ref, i), S, trans_b=True)
                dkw += dot(chunk_columns(v_new_ref, i), dS, trans_b=True)
                d_decay += jnp.sum(S.astype(jnp.float32) * dS.astype(jnp.float32))
            return dw, dqr, dkw, d_decay

        columns = jnp.zeros((chunk, block), jnp.float32)
        return jax.lax.fori_loop(0, value_blocks, step, (columns, columns, columns, jnp.zeros((), jnp.float32)))

    def key_products(j, sums):  # over the key columns: P = kb k^T, QK = q k^T and w's share of dX
        P, QK, dX = sums
        q, k, kb, kg = key_side(j)
        dw = terms_gradients(j, only_w=True)[0]
        return (P + dot(kb, k, trans_b=True), QK + dot(q, k, trans_b=True),
                dX + dot(dw.astype(operand), kg, trans_b=True))

    square = jnp.zeros((chunk, chunk), jnp.float32)
    P, QK, dX = jax.lax.fori_loop(0, key_blocks, key_products, (square, square, square))

    def value_products(j, sums):  # u = X vb (u's gradient is v_new's): u's share of dX, v's gradient, a's
        dX, d_beta, da = sums
        v, du = load(columns_of(v_ref, h, j)), chunk_columns(dv_new_ref, j)
        dvb = dot(Xo, du, trans_a=True)
        plgpu.store(columns_of(dv_ref, h, j), (dvb * beta[:, None]).astype(dv_ref.dtype))
        return (dX + dot(du, (v * beta[:, None]).astype(operand), trans_b=True), d_beta + jnp.sum(dvb * v, axis=1),
                da + dot(chunk_columns(do_ref, j), chunk_columns(v_new_ref, j), trans_b=True))

    dX, d_beta, da = jax.lax.fori_loop(0, value_blocks, value_products,
                                       (dX, jnp.zeros((chunk,), jnp.float32), square))

    # X = (I + N)^-1 with N = P D strictly below the diagonal; a = QK D
    dN = jnp.where(cols < rows, -inverse_dot(inverse_dot(X, dX, trans_a=True), X, trans_b=True), 0.0)
    dP, dQK = (dN * D).astype(operand), (da * D).astype(operand)
    dD = dN * P + da * QK

    def key_gradients(j, sums):  # dq and dk on key columns block j, and the sums toward beta, e_r, e_w, decay
        d_beta, d_e_r, d_e_w, d_decay = sums
        q, k, kb, kg = key_side(j)
        dw, dqr, dkw, d_decay_share = terms_gradients(j, only_w=False)
        dkg = dot(Xo, dw.astype(operand), trans_a=True)
        dkb = dkg * e_r[:, None] + dot(dP, k)
        dq = dot(dQK, k) + dqr * e_r[:, None]
        dk = dot(dQK, q, trans_a=True) + dot(dP, kb, trans_a=True) + dkb * beta[:, None] + dkw * e_w[:, None]
        plgpu.store(columns_of(dq_ref, h, j), dq.astype(dq_ref.dtype))
        plgpu.store(columns_of(dk_ref, h, j), dk.astype(dk_ref.dtype))
        return (d_beta + jnp.sum(dkb * k, axis=1), d_e_r + jnp.sum(dkg * kb, axis=1) + jnp.sum(dqr * q, axis=1),
                d_e_w + jnp.sum(dkw * k, axis=1), d_decay + d_decay_share)

    rows_sum = jnp.zeros((chunk,), jnp.float32)
    d_beta, d_e_r, d_e_w, d_decay = jax.lax.fori_loop(0, key_blocks, key_gradients,
                                                      (d_beta, rows_sum, rows_sum, jnp.zeros((), jnp.float32)))

    E = dD * D  # D = exp(cum_i - cum_j): + to row i's cum, - to column j's
    d_cum = jnp.sum(E, axis=1) - jnp.sum(E, axis=0) + d_e_r * e_r - d_e_w * e_w
    d_cum += jnp.where(index == chunk - 1, jnp.sum(d_e_w * e_w) + d_decay * decay, 0.0)  # through cum_last
    plgpu.store(dg_ref.at[b, tokens, h], jnp.sum(jnp.where(causal, d_cum[:, None], 0.0), axis=0))  # cum sums g
    plgpu.store(dbeta_ref.at[b, tokens, h], d_beta)


def backward(q, k, v, g, beta, seg, prev, inverse, do, d_v_new, states, v_new, d_next, *, chunk: int,
             interpret: bool):
    """The gradients (dq, dk [B, T, Hk, dk], dv, dg, dbeta) of q, k, v, g and beta through the chunk terms
    (`forward`'s; q, k, v in the terms' operand dtype, T whole chunks), from the saved `inverse` [B, H, n, C,
    C] float32, what the recurrence saved (the states entering the chunks [B, H, n, dk, dv] and v_new [B,
    H, n, C, dv]) and its backward pass gave (the outputs' gradient do and dv_new [B, H, n, C, dv], the
    gradients of the states the chunks leave [B, H, n, dk, dv]), in the operand dtype: the terms'
    gradients (dw = -dv_new S^T, da = do v_new^T, dqr = do S^T, dkw = v_new dS^T, ddecay = <S, dS>) are
    taken on chip. dv in v's dtype, dq and dk too where each key head has one value head (float32 where
    several share it, their shares summed after), dg and dbeta float32."""
    _check_chunk(chunk)
    if any(t.dtype != v.dtype for t in (q, k, do, d_v_new, states, v_new, d_next)):
        raise ValueError("the chunk terms' gradient kernel takes its products' operands in one dtype, v's")
    B, T, H, dk = *v.shape[:3], k.shape[-1]
    group = H // k.shape[2]
    # with more value heads than key heads, a program's dq and dk are its value head's share, summed after
    per_head = v.dtype if group == 1 else jnp.float32
    shapes = [((B, T, H, dk), per_head), ((B, T, H, dk), per_head), (v.shape, v.dtype), (g.shape, jnp.float32),
              (g.shape, jnp.float32)]
    call = kernel_call(
        functools.partial(_backward_kernel, chunk=chunk, heads=H, group=group, block=_block(dk, v.shape[-1])),
        tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes),
        interpret=interpret,
        grid=(B * H, T // chunk),
        compiler_params=plgpu.CompilerParams(num_warps=BACKWARD_NUM_WARPS, num_stages=1),
        name=BACKWARD_NAME,
    )
    dq, dk_, dv, dg, dbeta = call(q, k, v, g, beta, seg, prev, inverse, do, d_v_new, states, v_new, d_next)
    by_key_head = lambda t: t.reshape(B, T, k.shape[2], group, dk).sum(axis=3)  # noqa: E731
    return by_key_head(dq), by_key_head(dk_), dv, dg, dbeta


def _call_shape(name: str, operand_dims: list, result_dims: tuple) -> tuple[int, int, int, int]:
    """(value heads x chunks, the chunk, dk, dv) of a call of the kernel `name`."""
    (B, T, H, dv), dk = operand_dims[2], operand_dims[0][-1]  # v [B, T, H, dv], q [B, T, Hk, dk]
    # the forward's first result u [B, H, n, C, dv]; the backward's operand the inverses [B, H, n, C, C]
    C = result_dims[3] if name == FORWARD_NAME else operand_dims[7][-1]
    return B * H * (T // C), C, dk, dv


def call_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> float | None:
    """The kernels' FLOPs in a compiled program, for the planner, per value head and chunk: the forward's
    products of blocks on and below the diagonal, 2 b^2 (3 dk + dv) each (N's, a's, w's and u's; b = 16),
    and the inverse's; the backward's C^2 (16 dk + 6 dv) in its products of width dk and dv, 8 C dk dv
    in the terms' gradients from the states' (dw twice, dqr, dkw) and 4 C^3 in the inverse's gradient;
    None for any other call."""
    name = triton_kernel_name(target, attributes)
    if name not in (FORWARD_NAME, BACKWARD_NAME):
        return None
    chunks, C, dk, dv = _call_shape(name, operand_dims, result_dims)
    if name == FORWARD_NAME:
        count = C // DIAGONAL_BLOCK
        per_chunk = count * (count + 1) // 2 * 2 * DIAGONAL_BLOCK**2 * (3 * dk + dv) + products_flops(C)
    else:
        per_chunk = C**2 * (16 * dk + 6 * dv + 4 * C) + 8 * C * dk * dv
    return float(chunks * per_chunk)


def float32_flops(target: str, attributes: str, operand_dims: list, result_dims: tuple) -> tuple[float, float] | None:
    """(FLOPs at IEEE precision, FLOPs as three TF32 products) of the products the kernels take in float32
    whatever the terms' dtype, for the planner: the forward's inverse (IEEE), the backward's 4 C^3 of the
    inverse's gradient (three TF32 products); None for any other call."""
    name = triton_kernel_name(target, attributes)
    if name not in (FORWARD_NAME, BACKWARD_NAME):
        return None
    chunks, C, _, _ = _call_shape(name, operand_dims, result_dims)
    return (chunks * products_flops(C), 0.0) if name == FORWARD_NAME else (0.0, float(chunks * 4 * C**3))
