"""The gated delta rule as FLA structures it on a GPU, whatever the backend
of its two kernels: the chunk-local work for all chunks at once, and only
the chunk-to-chunk state recurrence in sequence, one kernel launch per pass.

1. every chunk's WY / UT terms, intra-chunk attention and decays, for all
   chunks at once: `chunks.chunk_terms`' batched XLA operations, or a
   backend's kernel;
2. the forward kernel walks the chunks of one (sequence, head) and block of
   value columns with the state on chip, doing only what the next chunk
   waits for (v_new = u - w S, S <- decay S + kw^T v_new) and writing the
   state entering each chunk and v_new; the outputs o = qr S + a v_new are
   then computed for all chunks at once;
3. the backward kernel walks the chunks in reverse with the state's
   gradient on chip (dv_new = a^T do + kw dS, dS <- qr^T do + decay dS -
   w^T dv_new); the chunk terms' gradients are again batched products, and
   from them a backend's kernel (or autodiff through step 1) reaches q, k,
   v, g and beta.

A backend gives the two kernels (`rule(forward, backward)`, and kernels for
the chunks' inverse, the outputs and the chunk terms' gradient if it has
them):
`forward(u, w, kw, decay, state, interpret)` -> (final state float32,
states entering the chunks, v_new) and `backward(do, d_final, w, a, qr, kw,
decay, interpret)` -> (dv_new, gradients of the states the chunks leave,
of the initial state float32), the chunk terms [BH, n, C, ...] in their
operand dtype (bf16 when v is bf16, as FLA's; float32 otherwise)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.linear_attention.chunks import ChunkTerms, chunk_terms_and_inverse, over_blocks

CHUNK = 64  # tokens per chunk, as FLA's
# Tokens whose chunks run at once. Longer sequences run a block at a time under a checkpoint: the chunk
# terms and the states entering each chunk (what the backward kernel reads) are O(block), and a block's
# forward runs twice in training. 32,768 tokens of 6 heads of 128 hold about 0.8 GB of them in float32.
BLOCK = 32_768


def rule(forward, backward, outputs=None, terms_forward=None, terms_backward=None):
    """The gated delta rule on a backend's two kernels, with `gated_delta.chunked`'s contract: o [B, S, H,
    dv] in v's dtype and the final state [B, H, dk, dv] in float32, `block` tokens at a time (fewer when
    the sequence is shorter), each block's chunks at once. A backend may have kernels for the batched
    steps too (XLA's otherwise): `outputs(qr, a, states, v_new, interpret)` o = qr S + a v_new;
    `terms_forward(q, k, v, g, beta, seg, prev, chunk=, interpret=)` the chunk terms and their inverses
    (`chunks.chunk_terms_and_inverse`), and `terms_backward(q, k, v, g, beta, seg, prev, inverse,
    cotangents, chunk=, interpret=)` their gradient (autodiff through XLA's terms without it; a backend
    with `terms_forward` has it)."""
    if terms_forward and not terms_backward:
        raise ValueError("a backend's chunk terms kernel needs its gradient's")
    recurrence = _recurrence(forward, backward, outputs or _outputs)
    terms = _terms(terms_forward, terms_backward)

    def run(q, k, v, g, beta, segment_ids=None, initial_state=None, segment_before=None, *, interpret: bool = False,
            chunk: int = CHUNK, block: int = BLOCK):
        block = min(block, -(-v.shape[1] // chunk) * chunk)
        run_block = functools.partial(_block, recurrence=recurrence, terms=terms, chunk=chunk, interpret=interpret)
        return over_blocks(run_block, (q, k, v, g, beta), segment_ids, initial_state, segment_before, block=block)

    return run


def _terms(terms_forward, terms_backward):
    """(q, k, v, g, beta, seg, prev, chunk, interpret) -> the `ChunkTerms` in the operand dtype of v's,
    computed by `terms_forward` and differentiated by `terms_backward` where the backend has them."""

    def kernel_tokens(q, k, v, g, beta):  # what the kernels take: q, k, v in the operand dtype, g, beta float32
        operand = jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32
        return [t.astype(operand) for t in (q, k, v)] + [t.astype(jnp.float32) for t in (g, beta)]

    def terms_and_inverse(q, k, v, g, beta, seg, prev, chunk, interpret):
        if terms_forward is None:
            operand = jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32
            return chunk_terms_and_inverse(q, k, v, g, beta, seg, prev, chunk=chunk, operand=operand)
        return terms_forward(*kernel_tokens(q, k, v, g, beta), seg, prev, chunk=chunk, interpret=interpret)

    if terms_backward is None:
        return lambda *args: terms_and_inverse(*args)[0]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
    def terms(q, k, v, g, beta, seg, prev, chunk, interpret):
        return terms_and_inverse(q, k, v, g, beta, seg, prev, chunk, interpret)[0]

    def with_residuals(q, k, v, g, beta, seg, prev, chunk, interpret):
        result, inverse = terms_and_inverse(q, k, v, g, beta, seg, prev, chunk, interpret)
        return result, (q, k, v, g, beta, seg, prev, inverse)

    def gradient(chunk, interpret, saved, cotangents):
        *tokens, seg, prev, inverse = saved
        grads = terms_backward(*kernel_tokens(*tokens), seg, prev, inverse, ChunkTerms(*cotangents), chunk=chunk,
                               interpret=interpret)
        return (*(d.astype(t.dtype) for d, t in zip(grads, tokens)), None, None)

    terms.defvjp(with_residuals, gradient)
    return terms


def _block(state, inputs, *, recurrence, terms, chunk: int, interpret: bool):
    """One block: (state in, (q, k, v, g, beta, segments, previous segments)) -> (state out, o)."""
    q, k, v, g, beta, segment_ids, previous = inputs
    B, T, H, dv = v.shape
    dk = k.shape[-1]
    terms = terms(q, k, v, g, beta, segment_ids, previous, chunk, interpret)
    heads = lambda t: t.reshape(B * H, *t.shape[2:])  # noqa: E731  [B, H, ...] -> [B H, ...]
    matrices = (heads(t) for t in (terms.u, terms.w, terms.a, terms.qr, terms.kw))
    o, state = recurrence(*matrices, heads(terms.decay), heads(state), interpret)
    o = jnp.moveaxis(o.reshape(B, H, T, dv), 1, 2)
    return state.reshape(B, H, dk, dv), o.astype(v.dtype)


def _by_chunk(spec: str, x, y, operand, result=jnp.float32):
    """A product batched over all chunks: in `operand` (bf16 or float32) with
    float32 accumulation, float32 at the highest precision; the sums rounded
    to `result`."""
    precision = jax.lax.Precision.HIGHEST if operand == jnp.float32 else None
    return jnp.einsum(spec, x.astype(operand), y.astype(operand), precision=precision,
                      preferred_element_type=result)


def _outputs(qr, a, states, v_new, interpret):
    """o = qr S + a v_new [BH, n, C, dv] for every chunk at once, in float32."""
    operand = qr.dtype
    return _by_chunk("bnck,bnkv->bncv", qr, states, operand) + _by_chunk("bncj,bnjv->bncv", a, v_new, operand)


def _recurrence(forward, backward, outputs):
    """(u, w, a, qr, kw, decay, state, interpret) -> (o [BH, T, dv], final state) of the chunks' terms
    [BH, n, ...] from `state` [BH, dk, dv], differentiable through the backend's backward kernel."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def recurrence(u, w, a, qr, kw, decay, state, interpret):
        return recurrence_forward(u, w, a, qr, kw, decay, state, interpret)[0]

    def recurrence_forward(u, w, a, qr, kw, decay, state, interpret):
        final, states, v_new = forward(u, w, kw, decay, state, interpret)
        o = outputs(qr, a, states, v_new, interpret)
        return (o.reshape(o.shape[0], -1, o.shape[-1]), final), (w, a, qr, kw, decay, states, v_new)

    def recurrence_backward(interpret, saved, cotangents):
        w, a, qr, kw, decay, states, v_new = saved
        do, d_final = cotangents
        BH, n, C, dk = w.shape
        operand = w.dtype
        do = do.reshape(BH, n, C, -1).astype(operand)
        d_v_new, d_next, d_state = backward(do, d_final, w, a, qr, kw, decay, interpret)
        # The chunk terms' gradients, for all chunks at once, in the terms' dtype (the sums float32).
        d_w = -_by_chunk("bncv,bnkv->bnck", d_v_new, states, operand, operand)
        d_a = _by_chunk("bncv,bnjv->bncj", do, v_new, operand, operand)
        d_qr = _by_chunk("bncv,bnkv->bnck", do, states, operand, operand)
        d_kw = _by_chunk("bncv,bnkv->bnck", v_new, d_next, operand, operand)
        d_decay = jnp.einsum("bnkv,bnkv->bn", states, d_next, preferred_element_type=jnp.float32)
        return d_v_new, d_w, d_a, d_qr, d_kw, d_decay, d_state

    recurrence.defvjp(recurrence_forward, recurrence_backward)
    return recurrence
