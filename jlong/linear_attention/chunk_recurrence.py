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
   w^T dv_new); the chunk terms' gradients are batched XLA products and
   autodiff through step 1 reaches q, k, v, g and beta, or a backend's
   kernel does both a chunk per program.

A backend gives the two kernels (`rule(forward, backward)`, and kernels for
the outputs and the chunk terms with their gradient if it has them):
`forward(u, w, kw, decay, state, interpret)` -> (final state float32,
states entering the chunks, v_new) and `backward(do, d_final, w, a, qr, kw,
decay, interpret)` -> (dv_new, gradients of the states the chunks leave,
of the initial state float32), the chunk terms [BH, n, C, ...] in their
operand dtype (bf16 when v is bf16, as FLA's; float32 otherwise)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong.linear_attention.chunks import chunk_terms_and_inverse, over_blocks

CHUNK = 64  # tokens per chunk, as FLA's
# Tokens whose chunks run at once. Longer sequences run a block at a time under a checkpoint: the chunk
# terms and the states entering each chunk (what the backward kernel reads) are O(block), and a block's
# forward runs twice in training. 32,768 tokens of 6 heads of 128 hold about 0.4 GB of them (the Triton rule's
# bf16 terms and states, float32 inverses).
BLOCK = 32_768


def rule(forward, backward, outputs=None, terms_forward=None, terms_backward=None):
    """The gated delta rule on a backend's two kernels, with `gated_delta.chunked`'s contract: o [B, S, H,
    dv] in v's dtype and the final state [B, H, dk, dv] in float32, `block` tokens at a time (fewer when
    the sequence is shorter), each block's chunks at once. A backend may have kernels for the batched
    steps too (XLA's otherwise): `outputs(qr, a, states, v_new, interpret)` o = qr S + a v_new, and, both
    or neither, `terms_forward(q, k, v, g, beta, seg, prev, chunk=, interpret=)` the chunk terms and their
    inverses (`chunks.chunk_terms_and_inverse`) with `terms_backward(q, k, v, g, beta, seg, prev, inverse,
    do, dv_new, states, v_new, d_next, chunk=, interpret=)` the gradients of q, k, v, g and beta through
    them from what the recurrence saved and its backward kernel gave (`chunk_terms_triton`)."""
    if bool(terms_forward) != bool(terms_backward):
        raise ValueError("a backend's chunk terms kernels come in pairs: the terms' and their gradient's")
    outputs = outputs or _outputs
    if terms_forward:
        step = _with_terms_kernels(forward, backward, outputs, terms_forward, terms_backward)
    else:
        step = _with_xla_terms(_recurrence(forward, backward, outputs))

    def run(q, k, v, g, beta, segment_ids=None, initial_state=None, segment_before=None, *, interpret: bool = False,
            chunk: int = CHUNK, block: int = BLOCK):
        block = min(block, -(-v.shape[1] // chunk) * chunk)
        run_block = functools.partial(_block, step=step, chunk=chunk, interpret=interpret)
        return over_blocks(run_block, (q, k, v, g, beta), segment_ids, initial_state, segment_before, block=block)

    return run


def _block(state, inputs, *, step, chunk: int, interpret: bool):
    """One block: (state in, (q, k, v, g, beta, segments, previous segments)) -> (state out, o)."""
    q, k, v, g, beta, segment_ids, previous = inputs
    B, T, H, dv = v.shape
    o, state = step(q, k, v, g, beta, segment_ids, previous, state, chunk, interpret)
    o = jnp.moveaxis(o.reshape(B, H, T, dv), 1, 2)  # [B H, n, C, dv] -> [B, T, H, dv]
    return state, o.astype(v.dtype)


def _operand(v):
    """The chunk terms' dtype: bf16 where v is (as FLA's kernels take them), float32 otherwise."""
    return jnp.bfloat16 if v.dtype == jnp.bfloat16 else jnp.float32


def _heads(t):
    """[B, H, ...] -> [B H, ...], as the recurrence's kernels take their operands."""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _with_xla_terms(recurrence):
    """(q, k, v, g, beta, seg, prev, state, chunk, interpret) -> (o [B H, n, C, dv], final state [B, H, dk,
    dv]): XLA's batched chunk terms around `recurrence`, autodiff through them."""

    def step(q, k, v, g, beta, seg, prev, state, chunk, interpret):
        terms = chunk_terms_and_inverse(q, k, v, g, beta, seg, prev, chunk=chunk, operand=_operand(v))[0]
        matrices = (_heads(t) for t in (terms.u, terms.w, terms.a, terms.qr, terms.kw))
        o, final = recurrence(*matrices, _heads(terms.decay), _heads(state), interpret)
        return o, final.reshape(state.shape)

    return step


def _with_terms_kernels(forward, backward, outputs, terms_forward, terms_backward):
    """`_with_xla_terms`' step on a backend's chunk terms kernels: the terms, the recurrence and the outputs
    forward; backward, the recurrence's backward kernel, then the terms' gradient kernel, which takes the
    terms' gradients (dw, da, dqr, dkw, ddecay) from what the recurrence saved and gave on chip."""

    def kernel_tokens(q, k, v, g, beta):  # q, k, v in the operand dtype, g and beta float32
        return [t.astype(_operand(v)) for t in (q, k, v)] + [t.astype(jnp.float32) for t in (g, beta)]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
    def step(q, k, v, g, beta, seg, prev, state, chunk, interpret):
        return with_residuals(q, k, v, g, beta, seg, prev, state, chunk, interpret)[0]

    def with_residuals(q, k, v, g, beta, seg, prev, state, chunk, interpret):
        terms, inverse = terms_forward(*kernel_tokens(q, k, v, g, beta), seg, prev, chunk=chunk,
                                       interpret=interpret)
        u, w, a, qr, kw, decay = map(_heads, terms)
        final, states, v_new = forward(u, w, kw, decay, _heads(state), interpret)
        o = outputs(qr, a, states, v_new, interpret)
        return (o, final.reshape(state.shape)), (q, k, v, g, beta, seg, prev, inverse, w, a, qr, kw, decay,
                                                 states, v_new)

    def gradient(chunk, interpret, saved, cotangents):
        *tokens, seg, prev, inverse, w, a, qr, kw, decay, states, v_new = saved
        do, d_final = cotangents
        do = do.astype(w.dtype)
        d_v_new, d_next, d_state = backward(do, _heads(d_final), w, a, qr, kw, decay, interpret)
        by_head = lambda t: t.reshape(d_final.shape[0], -1, *t.shape[1:])  # noqa: E731  [B H, ...] -> [B, H, ...]
        grads = terms_backward(*kernel_tokens(*tokens), seg, prev, inverse,
                               *map(by_head, (do, d_v_new, states, v_new, d_next)), chunk=chunk, interpret=interpret)
        return (*(d.astype(t.dtype) for d, t in zip(grads, tokens)), None, None, d_state.reshape(d_final.shape))

    step.defvjp(with_residuals, gradient)
    return step


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
    """(u, w, a, qr, kw, decay, state, interpret) -> (o [BH, n, C, dv], final state) of the chunks' terms
    [BH, n, ...] from `state` [BH, dk, dv], differentiable through the backend's backward kernel."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def recurrence(u, w, a, qr, kw, decay, state, interpret):
        return recurrence_forward(u, w, a, qr, kw, decay, state, interpret)[0]

    def recurrence_forward(u, w, a, qr, kw, decay, state, interpret):
        final, states, v_new = forward(u, w, kw, decay, state, interpret)
        o = outputs(qr, a, states, v_new, interpret)
        return (o, final), (w, a, qr, kw, decay, states, v_new)

    def recurrence_backward(interpret, saved, cotangents):
        w, a, qr, kw, decay, states, v_new = saved
        do, d_final = cotangents
        operand = w.dtype
        do = do.astype(operand)
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
