"""Causal self-attention kernels behind one interface, `attend`.

All kernels take q [B, S, H, d] and k, v [B, S, K, d] (H a multiple of K:
grouped-query attention without repeating k and v), optional segment ids
[B, S] (tokens attend only within their own segment, so packed documents
never see each other; non-decreasing, as jlong's data gives them), and
return o [B, S, H, d] in q's dtype.

- `reference`: plain XLA with the S x S score matrix; for tests.
- `blockwise`: the flash step in plain XLA (`jlong.attention.blockwise`);
  runs anywhere.
- `cudnn`: cuDNN's fused flash kernel (`jlong.attention.cudnn`); GPU only,
  16-bit inputs, packed documents up to `attention.max_documents` per
  sequence.
- `auto`: cuDNN where it applies, blockwise otherwise.

Both flash kernels run as a one-step ring (`jlong.attention.ring`), whose
custom VJP saves only the output and its float32 log-sum-exp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from einops import rearrange

from jlong.attention.blockwise import BlockwiseStep, group_queries
from jlong.attention.cudnn import CudnnStep
from jlong.attention.ring import gathered_attention, ring_attention
from jlong.attention.step import MASKED, StepKernel
from jlong.errors import JlongError
from jlong.options import ATTENTION_IMPLS, AttentionImpl

DEFAULT_MAX_DOCUMENTS = 64


def attend(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None, *, impl: AttentionImpl = "auto", block_size: int = 512,
           max_documents: int = DEFAULT_MAX_DOCUMENTS):
    """Causal attention of q [B,S,H,d] over k, v [B,S,K,d]; see the module doc."""
    return AttentionKernel(impl, block_size, max_documents).local(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """The `attention.*` settings: which kernel, and its knobs."""

    impl: AttentionImpl = "auto"
    block_size: int = 512  # the blockwise kernel's blocks
    max_documents: int = DEFAULT_MAX_DOCUMENTS  # cuDNN's packed documents per sequence

    def local(self, q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None):
        """Attention over the whole sequence, held on this device."""
        if self.impl == "reference":
            return reference_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS)
        kernel = self.step(q_BSHd, window=q_BSHd.shape[1])
        return ring_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS, kernel=kernel, axis=None, size=1)

    def ring(self, q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, *, axis: str, size: int):
        """Ring attention over mesh axis `axis` (the reference kernel has no
        steps, so a ring runs the blockwise one in its place)."""
        kernel = self.step(q_BsHd, window=q_BsHd.shape[1] // 2, reference="blockwise")
        return ring_attention(q_BsHd, k_BsKd, v_BsKd, segment_ids_Bs, kernel=kernel, axis=axis, size=size)

    def gathered(self, q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, *, axis: str, size: int):
        """Attention over every rank's keys and values of mesh axis `axis`,
        gathered at hand (`jlong.attention.ring.gathered_attention`)."""
        kernel = self.step(q_BsHd, window=q_BsHd.shape[1] // 2, reference="blockwise")
        return gathered_attention(q_BsHd, k_BSKd, v_BSKd, segment_ids_Bs, k_segment_ids_BS, kernel=kernel, axis=axis,
                                  size=size)

    def step(self, q_BSHd, *, window: int, reference: str = "reference") -> StepKernel:
        """The flash step kernel for queries like q on this backend; `window`
        is the shortest length a step attends over."""
        impl = choose_kernel(self.impl, platform=jax.default_backend(), dtype=q_BSHd.dtype, seq_len=window,
                             head_dim=q_BSHd.shape[-1])
        impl = reference if impl == "reference" else impl
        if impl == "blockwise":
            return BlockwiseStep(self.block_size)
        if impl == "cudnn":
            return CudnnStep(self.max_documents)
        raise JlongError(f"attention.impl must be one of {', '.join(ATTENTION_IMPLS)}, got {impl!r}")


def choose_kernel(impl: AttentionImpl, *, platform: str, dtype, seq_len: int, head_dim: int) -> str:
    """The kernel `impl` stands for on `platform` ("gpu" or "cpu"): `auto` is
    cuDNN where it applies (16-bit inputs, an even length of every window a
    step attends over, head_dim <= 256 and a multiple of 8), blockwise
    elsewhere. `seq_len` is the shortest window: the sequence, or half a
    ring chunk."""
    if impl != "auto":
        return impl
    cudnn = (
        platform == "gpu"
        and seq_len % 2 == 0  # cuDNN's training kernels refuse odd lengths
        and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        and head_dim <= 256
        and head_dim % 8 == 0
    )
    return "cudnn" if cudnn else "blockwise"


def _visible(q_index, k_index, q_segments, k_segments):
    """Causal and same-segment mask, broadcast to [B, 1, 1, Tq, Tk]."""
    mask = (k_index[None, :] <= q_index[:, None])[None]
    if q_segments is not None:
        mask = mask & (q_segments[:, :, None] == k_segments[:, None, :])
    return mask[:, None, None]


def reference_attention(q_BSHd, k_BSKd, v_BSKd, segment_ids_BS=None):
    """Materialises the full score matrix; the ground truth for tests."""
    S, d = q_BSHd.shape[1], q_BSHd.shape[3]
    q_BSKGd = group_queries(q_BSHd, k_BSKd.shape[2])
    scores_BKGSS = jnp.einsum("bqkgd,bskd->bkgqs", q_BSKGd, k_BSKd, preferred_element_type=jnp.float32) * (d**-0.5)
    index = jnp.arange(S)
    scores_BKGSS = jnp.where(_visible(index, index, segment_ids_BS, segment_ids_BS), scores_BKGSS, MASKED)
    probs_BKGSS = jax.nn.softmax(scores_BKGSS, axis=-1)
    o_BSKGd = jnp.einsum("bkgqs,bskd->bqkgd", probs_BKGSS.astype(v_BSKd.dtype), v_BSKd,
                         preferred_element_type=jnp.float32)
    return rearrange(o_BSKGd, "b q k g d -> b q (k g) d").astype(q_BSHd.dtype)
