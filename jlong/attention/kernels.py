"""Causal self-attention kernels: a registry of flash step kernels
(`jlong.attention.step`) behind one interface, `AttentionKernel`.

All kernels take q [B, S, H, d] and k, v [B, S, K, d] (H a multiple of K:
grouped-query attention without repeating k and v; v may have a head size
of its own, as multi-head latent attention's has), optional segment ids
[B, S] (tokens attend only within their own segment, so packed documents
never see each other; non-decreasing, as jlong's data gives them), and
return o [B, S, H, d] (v's head size) in q's dtype. With `window` w > 0 (sliding-window
attention, as Gemma's local layers have it) a token sees only itself and the
w - 1 tokens before it.

Each registered kernel (`KernelSpec`) says how it is made from the
attention settings, which settings are its own, what it cannot run (by
platform, dtype, head_dim, window length, masks), and, if its compiled
program holds custom calls, how the planner prices them (FLOPs and any
workspace the compiled program does not show). Built in, in the order
`auto` prefers them:

- `cudnn`: cuDNN's fused flash kernel (`jlong.attention.cudnn`); GPU only,
  16-bit inputs, packed documents up to `attention.max_documents` per
  sequence;
- `blockwise`: the flash step in plain XLA (`jlong.attention.blockwise`);
  runs anywhere.

Besides them, `reference` materialises the score matrix (for tests), and
`auto` is the first kernel that can run the call. Every flash kernel runs
as a one-step ring (`jlong.attention.ring`), whose custom VJP saves only the
output and its float32 log-sum-exp.

Attention sinks (`jlong.attention.sinks`: one logit per query head in every
softmax's denominator) are taken in by the paths around the steps, from a
step's output and log-sum-exp; a kernel says whether those are exact
enough for that (`KernelSpec.sinks`). A call with sinks never runs a
kernel that has not said so: `auto` passes it over, a kernel named by
`attention.impl` is refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from jlong.attention import cudnn
from jlong.attention.blockwise import DEFAULT_BLOCK_SIZE, BlockwiseStep, group_queries
from jlong.attention.latent_ring import latent_ring_attention
from jlong.attention.ring import gathered_attention, ring_attention
from jlong.attention.sliding import sliding_gathered_attention, sliding_ring_attention
from jlong.attention.step import MASKED, Band, CallCost, StepKernel
from jlong.errors import JlongError


class KernelQuery(NamedTuple):
    """What decides whether a kernel can run a call."""

    platform: str  # "gpu" or "cpu"
    dtype: object
    window: int  # the fewest tokens one step attends over: the sequence, or half a zigzag chunk
    head_dim: int  # the queries' and keys'
    value_head_dim: int = 0  # the values' (multi-head latent attention's differs); 0: head_dim


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str  # attention.impl
    make: Callable[[AttentionKernel], StepKernel]  # the step kernel, from the attention settings
    options: dict[str, int]  # the attention.* settings it reads, with their defaults
    cannot_run: Callable[[KernelQuery], str | None]  # why it cannot run a call (None: it can)
    # Prices one custom call of a compiled program, given its target, backend
    # config and operand shapes: None for a call that is not this kernel's.
    price: Callable[[str, dict, list], CallCost | None] | None = None
    # Whether attention sinks may be taken in from its steps' output and log-sum-exp
    # (a registered kernel says so once it is tested with them).
    sinks: bool = False


def _cudnn_cannot_run(query: KernelQuery) -> str | None:
    if query.platform != "gpu":
        return "cuDNN runs on GPUs only"
    if jnp.dtype(query.dtype) not in (jnp.bfloat16, jnp.float16):
        return "cuDNN takes 16-bit inputs"
    if query.window % 2:
        return "cuDNN's training kernels refuse odd lengths"
    if query.head_dim > 256 or query.head_dim % 8:
        return "cuDNN needs head_dim <= 256 and a multiple of 8"
    if query.value_head_dim > 256 or query.value_head_dim % 8:
        return "cuDNN needs the values' head size <= 256 and a multiple of 8"
    return None


_KERNELS: dict[str, KernelSpec] = {spec.name: spec for spec in (
    KernelSpec("cudnn", lambda a: cudnn.CudnnStep(a.max_documents), {"max_documents": cudnn.DEFAULT_MAX_DOCUMENTS},
               _cudnn_cannot_run, cudnn.price_call, sinks=True),
    KernelSpec("blockwise", lambda a: BlockwiseStep(a.block_size), {"block_size": DEFAULT_BLOCK_SIZE},
               lambda query: None, sinks=True),
)}


def register(spec: KernelSpec, *, preferred: bool = False) -> KernelSpec:
    """Makes `spec` known as attention.impl=<spec.name>; `auto` tries it first when `preferred`."""
    global _KERNELS
    others = {name: s for name, s in _KERNELS.items() if name != spec.name}
    _KERNELS = {spec.name: spec, **others} if preferred else {**others, spec.name: spec}
    return spec


def impl_names() -> list[str]:
    """Every attention.impl value: auto, the registered kernels, reference."""
    return ["auto", *_KERNELS, "reference"]


def check_impl(impl: str) -> None:
    if impl not in impl_names():
        raise JlongError(f"attention.impl must be one of {', '.join(impl_names())}, got {impl!r}")


def check_sinks(impl: str) -> None:
    """Raises a one-line `JlongError` for an attention.impl that cannot run attention sinks."""
    check_impl(impl)
    spec = _KERNELS.get(impl)
    if spec is not None and not spec.sinks:
        able = ", ".join(name for name, s in _KERNELS.items() if s.sinks)
        raise JlongError(f"attention.impl={impl} does not run attention sinks, which this model has: "
                         f"use attention.impl=auto or one of {able}")


def describe(kernel: AttentionKernel) -> str:
    """The kernel with its own settings: 'blockwise (block_size 512)'."""
    spec = _KERNELS.get(kernel.impl)
    own = ", ".join(f"{name} {getattr(kernel, name)}" for name in spec.options) if spec else ""
    return f"{kernel.impl} ({own})" if own else kernel.impl


def price_custom_call(target: str, backend_config: dict, operand_dims: list) -> CallCost | None:
    """The cost of a custom call as the kernel it belongs to prices it (None: no registered kernel's)."""
    for spec in _KERNELS.values():
        if spec.price and (cost := spec.price(target, backend_config, operand_dims)) is not None:
            return cost
    return None


def attend(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None, *, impl: str = "auto", block_size: int = DEFAULT_BLOCK_SIZE,
           max_documents: int = cudnn.DEFAULT_MAX_DOCUMENTS, window: int = 0, sink_logits_H=None):
    """Causal attention of q [B,S,H,d] over k, v [B,S,K,d], with sink logits [H] if given; see the module doc."""
    return AttentionKernel(impl, block_size, max_documents, window).local(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS,
                                                                          sink_logits_H)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The `attention.*` settings: which kernel, and the kernels' own
    settings; and the sliding window of the layers it serves (0: none)."""

    impl: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE  # the blockwise kernel's blocks
    max_documents: int = cudnn.DEFAULT_MAX_DOCUMENTS  # cuDNN's packed documents per sequence
    window: int = 0  # a token sees itself and the window - 1 tokens before it; 0 = every earlier token

    # Each path takes the sink logits [H] of q's heads (`jlong.attention.sinks`), or None for none.

    def local(self, q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None, sink_logits_H=None):
        """Attention over the whole sequence, held on this device."""
        if self.impl == "reference":
            return reference_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, window=self.window,
                                       sink_logits_H=sink_logits_H)
        kernel = self.step(q_BSHd, window=q_BSHd.shape[1], sinks=sink_logits_H is not None,
                           value_head_dim=v_BSKd.shape[-1])
        return ring_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, kernel=kernel, axis=None, size=1,
                              band=self.band, sink_logits_H=sink_logits_H)

    def ring(self, q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, sink_logits_H=None, *, axis: str, size: int):
        """Ring attention over mesh axis `axis` (the reference kernel has no
        steps, so a ring runs the blockwise one in its place); with a sliding
        window, the device's own chunk and its neighbours' halos
        (`jlong.attention.sliding`)."""
        kernel = self.step(q_BsHd, window=q_BsHd.shape[1] // 2, reference="blockwise",
                           sinks=sink_logits_H is not None, value_head_dim=v_BsKd.shape[-1])
        if self.window:
            return sliding_ring_attention(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, kernel=kernel, axis=axis,
                                          size=size, window=self.window, sink_logits_H=sink_logits_H)
        return ring_attention(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, kernel=kernel, axis=axis, size=size,
                              sink_logits_H=sink_logits_H)

    def latent_ring(self, q_BsHd, latent, weights, expand, segment_ids_Bs, *, axis: str, size: int):
        """Ring attention over mesh axis `axis` that moves a latent rather than
        keys and values (`jlong.attention.latent_ring`): expand(weights, latent)
        up-projects each arriving chunk to q's heads."""
        if self.window:
            raise ValueError("a sliding window on a ring moves keys and values (jlong.attention.sliding)")
        _, v = jax.eval_shape(expand, weights, latent)
        kernel = self.step(q_BsHd, window=q_BsHd.shape[1] // 2, reference="blockwise", value_head_dim=v.shape[-1])
        return latent_ring_attention(q_BsHd, latent, weights, expand, segment_ids_Bs, kernel=kernel, axis=axis,
                                     size=size)

    def gathered(self, q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, sink_logits_H=None, *, axis: str,
                 size: int):
        """Attention over every rank's keys and values of mesh axis `axis`,
        gathered at hand (`jlong.attention.ring.gathered_attention`); with a
        sliding window, a band on them, visiting only the chunks within its
        reach (`jlong.attention.sliding.sliding_gathered_attention`)."""
        kernel = self.step(q_BsHd, window=q_BsHd.shape[1] // 2, reference="blockwise",
                           sinks=sink_logits_H is not None, value_head_dim=v_BSKd.shape[-1])
        if self.window:
            return sliding_gathered_attention(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, kernel=kernel,
                                              axis=axis, size=size, window=self.window, sink_logits_H=sink_logits_H)
        return gathered_attention(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, kernel=kernel, axis=axis,
                                  size=size, sink_logits_H=sink_logits_H)

    @property
    def band(self) -> Band | None:
        """The sliding window of a causal step (None: no window)."""
        return Band(self.window) if self.window else None

    def step(self, q_BSHd, *, window: int, reference: str = "reference", sinks: bool = False,
             value_head_dim: int = 0) -> StepKernel:
        """The flash step kernel for queries like q on this backend; `window`
        is the shortest length a step attends over; `sinks`: the call has
        attention sinks (a kernel without them is refused); `value_head_dim`:
        the values' head size (0: q's)."""
        impl = choose_kernel(self.impl, platform=jax.default_backend(), dtype=q_BSHd.dtype, seq_len=window,
                             head_dim=q_BSHd.shape[-1], sinks=sinks, value_head_dim=value_head_dim)
        impl = reference if impl == "reference" else impl
        if sinks:
            check_sinks(impl)
        check_impl(impl)
        return _KERNELS[impl].make(self)


def choose_kernel(impl: str, *, platform: str, dtype, seq_len: int, head_dim: int, sinks: bool = False,
                  value_head_dim: int = 0) -> str:
    """The kernel `impl` stands for on `platform` ("gpu" or "cpu"): `auto` is
    the first registered kernel that can run the call (cuDNN where it
    applies, blockwise elsewhere), with attention sinks if `sinks`.
    `seq_len` is the shortest window: the sequence, or half a zigzag chunk;
    `value_head_dim` the values' head size where it is not `head_dim`'s."""
    if impl != "auto":
        return impl
    query = KernelQuery(platform, dtype, seq_len, head_dim, value_head_dim or head_dim)
    return next(name for name, spec in _KERNELS.items()
                if (spec.sinks or not sinks) and spec.cannot_run(query) is None)


def _visible(q_index, k_index, q_segments, k_segments, window: int = 0):
    """Causal, in-window and same-segment mask, broadcast to [B, 1, 1, Tq, Tk]."""
    mask = k_index[None, :] <= q_index[:, None]
    if window:
        mask &= q_index[:, None] - k_index[None, :] < window
    mask = mask[None]
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None, None]


def reference_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None, window: int = 0, sink_logits_H=None):
    """Materialises the full score matrix; the ground truth for tests. The
    sink logits [H] (if given) join each head's softmax as one more score
    with no value."""
    S, d = q_BSHd.shape[1], q_BSHd.shape[3]
    K = k_BSKd.shape[2]
    q_BSKGd = group_queries(q_BSHd, K)
    scores_BKGSS = jnp.einsum("bqkgd,bskd->bkgqs", q_BSKGd, k_BSKd, preferred_element_type=jnp.float32) * (d**-0.5)
    index = jnp.arange(S)
    scores_BKGSS = jnp.where(_visible(index, index, segment_ids_BS, segment_ids_BS, window), scores_BKGSS, MASKED)
    if sink_logits_H is not None:
        sinks_BKGS1 = jnp.broadcast_to(sink_logits_H.astype(jnp.float32).reshape(K, -1)[None, :, :, None, None],
                                       (*scores_BKGSS.shape[:-1], 1))
        probs_BKGSS = jax.nn.softmax(jnp.concatenate([scores_BKGSS, sinks_BKGS1], axis=-1), axis=-1)[..., :-1]
    else:
        probs_BKGSS = jax.nn.softmax(scores_BKGSS, axis=-1)
    o_BSKGd = jnp.einsum("bkgqs,bskd->bqkgd", probs_BKGSS.astype(v_BSKd.dtype), v_BSKd,
                         preferred_element_type=jnp.float32)
    return rearrange(o_BSKGd, "b q k g d -> b q (k g) d").astype(q_BSHd.dtype)
