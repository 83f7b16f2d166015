"""The gated delta rule, the recurrence of Gated DeltaNet (Yang, Kautz and
Hatamizadeh, arXiv 2412.06464), as kernels over one device's heads.

Per head, with a state S [dk, dv] that starts at zero (or at a given state):

    S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T
    o_t = S_t^T q_t

Packed documents: a token whose segment id differs from the token before it
starts from a zero state, so each document runs exactly as if alone.

`chunked` is what the model trains with: the sequence in chunks of
`CHUNK` tokens, each chunk's tokens related to each other by one small
triangular solve (the WY / UT representation of the products of
(I - beta k k^T)), and the state carried from chunk to chunk by a `lax.scan`
with a static trip count. Chunks are grouped in blocks of `CHUNKS_PER_BLOCK`
under a checkpoint, so the backward pass keeps one state per block and
recomputes a block at a time: memory is bounded by a block, not the sequence.
Everything is computed in float32.

`triton` (`jlong.linear_attention.gated_delta_triton`) is the same chunked
form as a GPU runs it fast (`jlong.linear_attention.chunk_recurrence`): the
chunks' terms for all chunks at once, the recurrence from chunk to chunk in
one Pallas Triton kernel per pass, the terms, their gradient and the
outputs in Pallas Triton kernels too; `triton_recurrence` is its recurrence
kernels alone, the terms and outputs batched XLA products (both listed
while jax has Pallas' Triton backend). `mosaic` (`gated_delta_mosaic`) runs
that recurrence in Pallas Mosaic GPU kernels for Hopper (TMA and wgmma;
bf16 terms, key and value widths multiples of 64): what GPUs run once the
Triton backend is gone.

`recurrent` is the rule token by token (a `lax.scan` over tokens): the
reference tests compare the chunked forms with.

`KERNELS` holds them by name (setting `kernels.gated_delta`); `kernel_for`
is what `auto` picks on a platform: on a GPU the first of `GPU_PREFERENCE`
whose GPU kernels have all run on a GPU (`jlong.kernel_runs`; the others
are chosen by name only); `rule` a kernel ready to call there (a GPU kernel
on the CPU runs in its interpreter).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jlong import kernel_runs
from jlong.linear_attention import gated_delta_mosaic
from jlong.linear_attention.chunks import chunk_terms, over_blocks, segment_before_first
from jlong.ops.pallas_calls import has_pallas_triton
from jlong.ops.tiling import varying_like

CHUNK = 128  # tokens related by one triangular solve
CHUNKS_PER_BLOCK = 16  # chunks recomputed together in the backward pass (one saved state per block)


def chunked(q, k, v, g, beta, segment_ids=None, initial_state=None, segment_before=None, *, chunk: int = CHUNK,
            chunks_per_block: int = CHUNKS_PER_BLOCK):
    """o [B, S, H, dv] in v's dtype and the final state [B, H, dk, dv] in float32.

    q, k [B, S, Hk, dk] (Hk dividing H: value head h reads key head h // (H / Hk)),
    v [B, S, H, dv], g (log decay, <= 0) and beta [B, S, H]; `segment_ids`
    [B, S] separate packed documents; `initial_state` [B, H, dk, dv] is the
    state before the first token (zero when None), left by a token of
    segment `segment_before` [B] (unset: the first token's own, so the first
    token continues it; another segment starts afresh)."""
    S = v.shape[1]
    chunk = min(chunk, 1 << max(S - 1, 1).bit_length())  # a power of two (`unit_lower_inverse`)
    block = chunk * max(1, min(chunks_per_block, -(-S // chunk)))
    return over_blocks(functools.partial(_block, chunk=chunk), (q, k, v, g, beta), segment_ids, initial_state,
                       segment_before, block=block)


def _block(state, inputs, *, chunk: int):
    """One block of chunks: (state in, (q, k, v, g, beta, segments, previous segments)) -> (state out, o)."""
    q, k, v, g, beta, seg, prev = inputs
    B, T, H, dv = v.shape
    terms = chunk_terms(q, k, v, g, beta, seg, prev, chunk=chunk)

    def one_chunk(state, xs):
        u, w, a, qr, kw, decay_c = xs
        v_new = u - w @ state
        o = qr @ state + a @ v_new
        state = state * decay_c[..., None, None] + jnp.swapaxes(kw, -1, -2) @ v_new
        return state, o

    state, o = jax.lax.scan(one_chunk, state, tuple(jnp.moveaxis(t, 2, 0) for t in terms))
    o = jnp.moveaxis(o, 0, 2)  # [B, H, n, C, dv]
    return state, jnp.moveaxis(o, 1, 3).reshape(B, T, H, dv).astype(v.dtype)


def recurrent(q, k, v, g, beta, segment_ids=None, initial_state=None, segment_before=None):
    """The rule token by token: the same arguments and results as `chunked`."""
    B, S, H, dv = v.shape
    dk = k.shape[-1]
    group = H // k.shape[2]
    q, k = (jnp.repeat(t.astype(jnp.float32), group, axis=2) for t in (q, k))
    if segment_ids is None:
        segment_ids = jnp.zeros((B, S), jnp.int32)
    first = segment_before_first(segment_ids, initial_state, segment_before)
    starts = segment_ids != jnp.concatenate([first, segment_ids[:, :-1]], axis=1)
    state = jnp.zeros((B, H, dk, dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
    state = varying_like(state, v)

    def step(state, xs):
        q_t, k_t, v_t, g_t, beta_t, start_t = xs
        state = jnp.where(start_t[:, None, None, None], 0.0, state) * jnp.exp(g_t)[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", state, k_t)
        state = state + jnp.einsum("bhk,bhv->bhkv", k_t, (v_t - remembered) * beta_t[..., None])
        return state, jnp.einsum("bhkv,bhk->bhv", state, q_t)

    xs = (q, k, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), starts)
    state, o = jax.lax.scan(step, state, tuple(jnp.moveaxis(t, 1, 0) for t in xs))
    return jnp.moveaxis(o, 0, 1).astype(v.dtype), state


KERNELS = {"chunked": chunked, "recurrent": recurrent, "mosaic": gated_delta_mosaic.mosaic}
# Written for a GPU; `interpret=True` runs them anywhere.
GPU_KERNELS = frozenset({"triton", "triton_recurrence", "mosaic"})
# GPU kernels a model runs on GPUs only: jax's Mosaic GPU interpreter calls back to the host, which the
# model's checkpoints refuse. The rule alone runs interpreted anywhere up to `chunk_recurrence.BLOCK` tokens
# (longer sequences run block by block under a checkpoint); in float32 it runs no kernel at all.
GPU_ONLY_IN_MODELS = frozenset({"mosaic"})
# The GPU kernels each of KERNELS runs, by their names in a compiled program (the others run XLA's alone).
GPU_KERNEL_NAMES = {"mosaic": (gated_delta_mosaic.FORWARD, gated_delta_mosaic.BACKWARD)}
# What `auto` runs on a GPU: the first of these whose GPU kernels have all run on a GPU.
GPU_PREFERENCE = ("triton", "triton_recurrence", "mosaic", "chunked")
# (call_flops, kind) of the GPU kernels' custom calls, for the planner
PRICED_CALLS = ((gated_delta_mosaic.call_flops, "gated delta (mosaic)"),)
# Functions giving the (IEEE, three-TF32) FLOPs of the products a Triton kernel's call takes in float32
# whatever its operands' dtype, for the planner (None: not that kernel's call)
FLOAT32_FLOPS = ()
if has_pallas_triton():  # the Triton kernels, while jax has Pallas' Triton backend
    from jlong.linear_attention import chunk_terms_triton, gated_delta_triton

    KERNELS["triton"] = gated_delta_triton.triton
    KERNELS["triton_recurrence"] = gated_delta_triton.triton_recurrence
    _RECURRENCE = (gated_delta_triton.FORWARD, gated_delta_triton.BACKWARD)
    GPU_KERNEL_NAMES |= {"triton": (*_RECURRENCE, gated_delta_triton.OUTPUTS, chunk_terms_triton.FORWARD_NAME,
                                    chunk_terms_triton.BACKWARD_NAME),
                         "triton_recurrence": _RECURRENCE}
    PRICED_CALLS = ((gated_delta_triton.call_flops, "gated delta"),
                    (gated_delta_triton.outputs_call_flops, "gated delta outputs"),
                    (chunk_terms_triton.call_flops, "gated delta chunk terms"), *PRICED_CALLS)
    FLOAT32_FLOPS = (chunk_terms_triton.float32_flops,)


def kernel_for(platform: str, runs: kernel_runs.KernelRuns | None = None) -> str:
    """The kernel `auto` runs on `platform` ("gpu" or "cpu"): on a GPU the first of `GPU_PREFERENCE` listed
    here whose GPU kernels have all run on a GPU (`runs`, by default the committed record); `chunked`
    elsewhere."""
    if platform != "gpu":
        return "chunked"
    runs = runs or kernel_runs.recorded()
    return next(name for name in GPU_PREFERENCE if name in KERNELS and runs.ran(GPU_KERNEL_NAMES.get(name, ())))


def rule(name: str, *, interpret: bool = False):
    """The kernel `name`, interpreted when `interpret` and it is a GPU kernel."""
    kernel = KERNELS[name]
    return functools.partial(kernel, interpret=True) if interpret and name in GPU_KERNELS else kernel
