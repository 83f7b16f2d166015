"""The flash step (`jlong.attention.step`) in cuDNN's fused kernel.

jax's public `dot_product_attention(implementation="cudnn")` covers only
plain causal attention. The rest of what a step needs exists below it, in
jax's private `jax._src.cudnn.fused_attention_stablehlo` (the same operands,
parameters and enums from 0.10.2 through 0.11.2), whose two inner primitives
this module binds directly:

- packed documents: cuDNN's ragged ("THD") mode, each document a segment
  with its own query and key/value offsets and lengths;
- the float32 log-sum-exp of the forward pass (cuDNN's softmax statistics;
  the public `return_residual` rounds it to bf16 and drops its gradient);
- a backward pass given an external output and log-sum-exp (a ring's merged
  ones).

Binding the inner primitives also skips two traps of jax's wrappers: the
packed mode's offset fix-up scales the key/value offsets by the *query*
head count (wrong under grouped-query attention; fixed upstream after
0.10.2), and the compute-capability check consults the default backend,
which is the CPU when planning deviceless. The names are looked up through
`jlong.jax_private` (one line naming the name where a jax lacks it);
`tests/test_cudnn_step.py` fails, naming the function, if they change.

Ragged mode, as XLA hands it to cuDNN: with M segments per sequence,
segment lengths [B, M] and element offsets [B, M+1] list the batch's
non-empty segments first (row by row) and pad with length 0 at offset
B x T x stride; the softmax statistics come back as [B*M, H, T], segment c's
query p at [c, :, p]. Rows covered by no segment are left unwritten by the
kernel; this module zeroes them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from jlong.attention.blockwise import BlockwiseStep
from jlong.attention.step import MASKED, Band, CallCost, Documents
from jlong.jax_private import private
from jlong.options import DEFAULT_MAX_DOCUMENTS

CUSTOM_CALL = "__cudnn$fmha"  # the prefix of its custom calls' targets in a compiled program

FUSED_ATTENTION = "jax._src.cudnn.fused_attention_stablehlo"  # the private module whose primitives are bound


@functools.cache
def _fused(name: str):
    """A name of jax's private cuDNN module, looked up at first use (a jax
    without it fails there, in one line, and only where cuDNN is asked for)."""
    return private(FUSED_ATTENTION, name)


OFF_DIAGONAL_SEGMENTS = 2  # one shared document, plus one so that cuDNN takes offsets (it wants M > 1)


class Ragged(NamedTuple):
    """A step's segments in cuDNN's form (see the module doc)."""

    q_seqlen: jax.Array  # [B, M] int32
    kv_seqlen: jax.Array  # [B, M]
    q_offsets: jax.Array  # [B, M+1] int32, in elements
    kv_offsets: jax.Array  # [B, M+1]


def fused_forward(q_BTHd, k_BSKd, v_BSKd, ragged: Ragged | None, mask: str, scale: float, window: int | None = None):
    """cuDNN's forward: (o [B, T, H, d] in q's dtype, statistics [B*M, H, T] float32);
    with `window`, cuDNN's own sliding window (a query sees itself and the window - 1 keys before it)."""
    empty = jnp.zeros(0, q_BTHd.dtype)
    lengths_and_offsets = (empty,) * 4 if ragged is None else tuple(ragged)
    o, stats = _fused("_dot_product_attention_fwd_p").bind(
        q_BTHd, k_BSKd, v_BSKd, empty, *lengths_and_offsets, empty, empty,
        scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False), mask_type=_fused("MaskType")[mask],
        layout=_fused("AttentionLayout").BTNH.value, sliding_window_length=window, is_training=True)
    return o, stats


def fused_backward(q_BTHd, k_BSKd, v_BSKd, ragged: Ragged | None, mask: str, scale: float, stats, o_BTHd, do_BTHd,
                   window: int | None = None):
    """cuDNN's backward: (dq, dk, dv) in their inputs' dtypes."""
    empty = jnp.zeros(0, q_BTHd.dtype)
    lengths_and_offsets = (empty,) * 4 if ragged is None else tuple(ragged)
    dq, dk, dv = _fused("_dot_product_attention_bwd_p").bind(
        q_BTHd, k_BSKd, v_BSKd, empty, *lengths_and_offsets, empty, empty, stats, o_BTHd, do_BTHd,
        scale=scale, seed=0, dropout_rate=0.0, variadic_args=(False, False), mask_type=_fused("MaskType")[mask],
        layout=_fused("AttentionLayout").BTNH.value, sliding_window_length=window)
    return dq, dk, dv


@dataclasses.dataclass(frozen=True)
class CudnnStep:
    """The step kernel of `jlong.attention.step` in cuDNN, with up to
    `max_documents` packed documents per sequence (the cap sizes cuDNN's
    statistics, [B x max_documents, H, T] float32 per call).

    A causal step's sliding window is cuDNN's own (its left diagonal bound:
    no mask tensor, no score blocks outside the band). The band of an
    unmasked step at a distance (a ring's halo windows,
    `jlong.attention.sliding`: a window's worth of queries per chunk) runs in
    the blockwise kernel.

    Values of a head size other than the keys' (multi-head latent attention)
    run zero-padded to one size (`_one_head_size`): the head sizes jlong has
    run in cuDNN, at the padding's FLOPs. cuDNN 9.10 runs two sizes natively
    on Hopper (d_qk 192 with d_v 128), not yet tried on a GPU here."""

    max_documents: int

    def forward(self, q_BTHd, k_BSKd, v_BSKd, docs: Documents | None, causal: bool, band: Band | None = None):
        if _banded_apart(causal, band):
            return BlockwiseStep().forward(q_BTHd, k_BSKd, v_BSKd, docs, causal, band)
        scale = q_BTHd.shape[-1] ** -0.5
        if (dv := v_BSKd.shape[-1]) != q_BTHd.shape[-1]:
            o, lse = self._forward(*_one_head_size(q_BTHd, k_BSKd, v_BSKd), docs, causal, band, scale)
            return o[..., :dv], lse
        return self._forward(q_BTHd, k_BSKd, v_BSKd, docs, causal, band, scale)

    def _forward(self, q_BTHd, k_BSKd, v_BSKd, docs, causal, band, scale):
        window = band and band.length
        if docs is None:
            mask = "CAUSAL" if causal else "NO_MASK"
            o, stats_BHT = fused_forward(q_BTHd, k_BSKd, v_BSKd, None, mask, scale, window)
            return o, stats_BHT
        segments = self._segments(docs, causal, q_BTHd, k_BSKd)

        def run():
            o, stats = fused_forward(q_BTHd, k_BSKd, v_BSKd, segments.ragged, segments.mask, scale, window)
            return segments.keep_queries(o), segments.keep_lse(segments.lse_of(stats))

        def nothing_visible():
            return jnp.zeros_like(q_BTHd), jnp.full_like(q_BTHd, MASKED, jnp.float32, _lse_shape(q_BTHd))

        return run() if causal else jax.lax.cond(segments.any, run, nothing_visible)

    def backward(self, q_BTHd, k_BSKd, v_BSKd, docs: Documents | None, causal: bool, o_BTHd, lse_BHT, do_BTHd,
                 band: Band | None = None):
        if _banded_apart(causal, band):
            return BlockwiseStep().backward(q_BTHd, k_BSKd, v_BSKd, docs, causal, o_BTHd, lse_BHT, do_BTHd, band)
        d, dv = q_BTHd.shape[-1], v_BSKd.shape[-1]
        scale = d ** -0.5
        o_BTHd, do_BTHd = o_BTHd.astype(q_BTHd.dtype), do_BTHd.astype(q_BTHd.dtype)
        if dv != d:
            size = max(d, dv)
            grads = self._backward(*_one_head_size(q_BTHd, k_BSKd, v_BSKd), docs, causal, _padded(o_BTHd, size),
                                   lse_BHT, _padded(do_BTHd, size), band, scale)
            return tuple(g[..., :n] for g, n in zip(grads, (d, d, dv)))
        return self._backward(q_BTHd, k_BSKd, v_BSKd, docs, causal, o_BTHd, lse_BHT, do_BTHd, band, scale)

    def _backward(self, q_BTHd, k_BSKd, v_BSKd, docs, causal, o_BTHd, lse_BHT, do_BTHd, band, scale):
        window = band and band.length
        if docs is None:
            mask = "CAUSAL" if causal else "NO_MASK"
            return fused_backward(q_BTHd, k_BSKd, v_BSKd, None, mask, scale, lse_BHT, o_BTHd, do_BTHd, window)
        segments = self._segments(docs, causal, q_BTHd, k_BSKd)

        def run():
            stats = segments.stats_of(lse_BHT)
            dq, dk, dv = fused_backward(q_BTHd, k_BSKd, v_BSKd, segments.ragged, segments.mask, scale, stats,
                                        o_BTHd, do_BTHd, window)
            return segments.keep_queries(dq), segments.keep_keys(dk), segments.keep_keys(dv)

        def nothing_visible():
            return jnp.zeros_like(q_BTHd), jnp.zeros_like(k_BSKd), jnp.zeros_like(v_BSKd)

        return run() if causal else jax.lax.cond(segments.any, run, nothing_visible)

    def _segments(self, docs: Documents, causal: bool, q_BTHd, k_BSKd) -> _Segments:
        if causal:
            per_row = _documents(docs.q, self.max_documents)
        else:
            per_row = _shared_document(docs.q, docs.k)
        return _Segments(per_row, q_BTHd, k_BSKd, causal)


def _padded(x, size: int):
    """x with its last axis zero-padded to `size`."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _one_head_size(q_BTHd, k_BSKd, v_BSKd):
    """q, k and v zero-padded to one head size, the larger of the keys' and the values' (latent attention's
    values are of a size of their own). The zeros change no score and no value: the output's and the
    gradients' padded columns are zero and cut off. The packed path's element offsets count one stride for
    q and o and one for k and v, so one size also keeps them right."""
    size = max(q_BTHd.shape[-1], v_BSKd.shape[-1])
    return _padded(q_BTHd, size), _padded(k_BSKd, size), _padded(v_BSKd, size)


def _banded_apart(causal: bool, band: Band | None) -> bool:
    """Whether a step's band is not cuDNN's (a causal step's window from the diagonal)."""
    return band is not None and not (causal and band.distance == 0)


def _lse_shape(q_BTHd):
    B, T, H, _ = q_BTHd.shape
    return (B, H, T)


class _RowSegments(NamedTuple):
    """Up to M segments of each row, the valid ones first: token starts and
    lengths [B, M]; and each query's segment [B, T] and whether a segment
    covers it, with the same for the keys [B, S]."""

    q_start: jax.Array
    q_len: jax.Array
    k_start: jax.Array
    k_len: jax.Array
    valid: jax.Array  # [B, M] bool
    q_segment: jax.Array  # [B, T] int32
    q_covered: jax.Array  # [B, T] bool
    k_covered: jax.Array  # [B, S] bool


def _documents(segment_ids_BT, max_documents: int) -> _RowSegments:
    """The runs of equal segment ids of each row: queries and keys are the same tokens."""
    B, T = segment_ids_BT.shape
    starts_BT = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    start_BM = jax.vmap(lambda row: jnp.nonzero(row, size=max_documents, fill_value=T)[0])(starts_BT)
    start_BM = start_BM.astype(jnp.int32)
    len_BM = jnp.diff(start_BM, append=jnp.full((B, 1), T, jnp.int32), axis=1)
    run_BT = jnp.cumsum(starts_BT, axis=1, dtype=jnp.int32) - 1
    covered_BT = run_BT < max_documents  # beyond the cap: no segment (the data check stops such batches)
    return _RowSegments(start_BM, len_BM, start_BM, len_BM, start_BM < T, jnp.minimum(run_BT, max_documents - 1),
                        covered_BT, covered_BT)


def _shared_document(q_segments_BT, k_segments_BS) -> _RowSegments:
    """Every key precedes every query, so a query sees only keys of the
    document that spans the boundary: the last key's, from the queries'
    first token on. Segment 0 is that document; the rest are empty (and start
    at the end, so starts rise along each row)."""
    B, S = k_segments_BS.shape
    T = q_segments_BT.shape[1]
    shared_B1 = k_segments_BS[:, -1:]
    q_len_B = jnp.sum(q_segments_BT == shared_B1, axis=1, dtype=jnp.int32)
    # A row whose queries share no document with the keys has no segment, on either side.
    k_len_B = jnp.where(q_len_B > 0, jnp.sum(k_segments_BS == shared_B1, axis=1, dtype=jnp.int32), 0)

    def first_then(x_B, empty):
        """[B, M]: x for segment 0, then the empty segments' value."""
        return jnp.concatenate([x_B[:, None], jnp.full((B, OFF_DIAGONAL_SEGMENTS - 1), empty, jnp.int32)], axis=1)

    return _RowSegments(first_then(jnp.zeros_like(q_len_B), T), first_then(q_len_B, 0),
                        first_then(S - k_len_B, S), first_then(k_len_B, 0), first_then(q_len_B, 0) > 0,
                        jnp.zeros((B, T), jnp.int32), jnp.arange(T)[None, :] < q_len_B[:, None],
                        jnp.arange(S)[None, :] >= (S - k_len_B)[:, None])


class _Segments:
    """Segments in cuDNN's form, and the maps between its per-segment
    statistics and per-token log-sum-exps."""

    def __init__(self, rows: _RowSegments, q_BTHd, k_BSKd, causal: bool):
        B, T, H, d = q_BTHd.shape
        S, K = k_BSKd.shape[1], k_BSKd.shape[2]
        M = rows.valid.shape[1]
        self.mask = "PADDING_CAUSAL" if causal else "PADDING"
        self.any = rows.valid.any()
        # Compacted index of each valid segment; the rest go past the end and are dropped.
        flat_valid = rows.valid.reshape(-1)
        slot = jnp.where(flat_valid, jnp.cumsum(flat_valid) - 1, B * M)
        row_BM = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, M))

        def compact(x_BM, fill):
            return jnp.full(B * M, fill, jnp.int32).at[slot].set(x_BM.reshape(-1), mode="drop")

        def offsets(start_BM, length, stride):
            """Element offsets [B, M+1] of the compacted segments into [B, length, heads, d]."""
            end = B * length * stride
            first = compact((row_BM * length + start_BM) * stride, end)
            return jnp.concatenate([first, jnp.full(B, end, jnp.int32)]).reshape(B, M + 1)

        self.ragged = Ragged(
            compact(rows.q_len, 0).reshape(B, M), compact(rows.k_len, 0).reshape(B, M),
            offsets(rows.q_start, T, H * d), offsets(rows.k_start, S, K * d),
        )
        self.segment_row = compact(row_BM, 0)
        self.segment_start = compact(rows.q_start, 0)
        self.segment_len = compact(rows.q_len, 0)
        # Each query token's compacted slot and position in its segment.
        m_BT, self.q_covered_BT, self.k_covered_BS = rows.q_segment, rows.q_covered, rows.k_covered
        self.q_slot_BT = jnp.minimum(jnp.take_along_axis(slot.reshape(B, M), m_BT, axis=1), B * M - 1)
        t_BT = jnp.arange(T, dtype=jnp.int32)[None, :]
        self.q_position_BT = jnp.clip(t_BT - jnp.take_along_axis(rows.q_start, m_BT, axis=1), 0, T - 1)

    def lse_of(self, stats_CHT):
        """Per-token log-sum-exp [B, H, T] from cuDNN's per-segment statistics [B*M, H, T]."""
        lse_BTH = stats_CHT[self.q_slot_BT, :, self.q_position_BT]
        return rearrange(lse_BTH, "b t h -> b h t")

    def stats_of(self, lse_BHT):
        """cuDNN's per-segment statistics [B*M, H, T] from a per-token log-sum-exp [B, H, T]."""
        T = lse_BHT.shape[2]
        p_T = jnp.arange(T, dtype=jnp.int32)
        token_CT = jnp.minimum(self.segment_start[:, None] + p_T, T - 1)
        stats_CTH = lse_BHT[self.segment_row[:, None], :, token_CT]
        stats_CTH = jnp.where((p_T < self.segment_len[:, None])[..., None], stats_CTH, 0.0)
        return rearrange(stats_CTH, "c t h -> c h t")

    def keep_queries(self, x_BT_):
        """x [B, T, ...] with the rows of queries outside every segment zeroed."""
        covered = self.q_covered_BT.reshape(self.q_covered_BT.shape + (1,) * (x_BT_.ndim - 2))
        return jnp.where(covered, x_BT_, jnp.zeros((), x_BT_.dtype))

    def keep_lse(self, lse_BHT):
        """A log-sum-exp [B, H, T] with queries outside every segment at `MASKED`."""
        return jnp.where(self.q_covered_BT[:, None, :], lse_BHT, MASKED)

    def keep_keys(self, x_BSKd):
        return jnp.where(self.k_covered_BS[:, :, None, None], x_BSKd, jnp.zeros((), x_BSKd.dtype))


def price_call(target: str, backend_config: dict, operand_dims: list[tuple[int, ...]]) -> CallCost | None:
    """The cost of one cuDNN attention custom call (None for another kernel's):
    4 x B x H x Sq x Skv x d FLOPs forward, 10 x backward (five matmuls: the
    scores are recomputed), times the visible fraction of a causal mask
    (within its sliding window, when the call has one).

    Compiled deviceless, cuDNN's graphs are never built, so their workspace
    buffers appear as u8[0] and XLA's buffer assignment leaves them out: a
    backward call's workspace is counted from cuDNN's own requirement
    (cudnn-frontend's SDPA backward node), a float32 dQ accumulator
    [B, H, Sq, d] and float32 softmax sums [B, H, Sq]; the forward pass
    needs none beyond its outputs."""
    if not target.startswith(CUSTOM_CALL):
        return None
    config = backend_config.get("cudnn_fmha_backend_config", {})
    B, H, Sq, Skv = (int(v) for v in config["intermediate_tensor_shape"]["dimensions"])
    head_dim = operand_dims[0][-1]
    backward = "Backward" in target
    mask = config.get("mask_type", "NO_MASK")
    visible = causal_fraction(Sq, int(config.get("sliding_window_length", 0))) if "CAUSAL" in mask and Sq == Skv \
        else 1.0
    flops = call_flops(B, H, Sq, Skv, head_dim, backward=backward, visible=visible)
    return CallCost(flops, backward, B * H * Sq * (head_dim + 1) * 4 if backward else 0)


def call_flops(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, *, backward: bool,
               visible: float = 1.0) -> float:
    """FLOPs of one cuDNN attention call: 4 x B x H x Sq x Skv x d forward
    (QK^T and PV), 10 x backward (five matmuls: the scores are recomputed),
    times the visible fraction of the scores."""
    return (10 if backward else 4) * batch * heads * q_len * kv_len * head_dim * visible


def causal_fraction(length: int, window: int = 0) -> float:
    """The fraction of a [length, length] score matrix a causal mask keeps:
    the lower triangle with its diagonal, within `window` of it (0: no window)."""
    w = min(window, length) if window else length
    visible = w * (w + 1) // 2 + (length - w) * w  # query p sees min(p + 1, w) keys
    return visible / (length * length)
