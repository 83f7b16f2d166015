"""The flash step: one query window's attention over one key window.

Every attention path of jlong is built from steps of this one shape. Local
attention is a single causal step; ring attention is a causal step over the
device's own chunk plus one unmasked step per chunk that arrives around the
ring (`jlong.attention.ring`). A step kernel has two methods:

- `forward(q, k, v, docs, causal, band=None)` -> (o [B, Tq, H, d], lse [B, H, Tq] float32):
  the softmax-normalised output over this key window alone and its
  log-sum-exp. Queries that see no key of the window get output 0 and
  log-sum-exp `MASKED`.
- `backward(q, k, v, docs, causal, o, lse, do, band=None)` -> (dq, dk, dv): the
  gradients through this window, given the output and log-sum-exp of the
  whole softmax the window is part of (a ring's merged ones), not the
  window's own.

q is [B, Tq, H, d], k and v [B, Tk, K, d] with H a multiple of K (each kv
head serves H/K consecutive query heads); v, and so o, may have a head size
of its own (multi-head latent attention's values are narrower than its
keys). The mask is one of two shapes:

- `causal=True`: queries and keys are the same tokens in sequence order
  (Tq = Tk); a query sees the keys at and before its own position.
- `causal=False`: every key precedes every query in the sequence; a query
  sees every key.

`docs` is None, or the segment ids (q's [B, Tq], k's [B, Tk]) of packed
documents, non-decreasing along the sequence as jlong's data gives them: a
query also needs a key of its own document.

`band` is None, or a sliding window (`Band`): a query also needs the key to
be fewer than `band.length` positions behind it (Hugging Face's convention:
a window of w sees itself and the w - 1 keys before it). The band's
`distance` is how many positions the step's first query comes after its
first key: 0 for a causal step, more for keys of an earlier chunk (the
ring's halo windows, `jlong.attention.sliding`).

Kernels: `jlong.attention.blockwise.BlockwiseStep` (plain XLA, runs
anywhere) and `jlong.attention.cudnn.CudnnStep` (cuDNN's fused kernel, GPU).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import jax

# Finite stand-in for -inf, so rows that see nothing give exp(..) = 0, not NaN.
MASKED = -1e30


class Documents(NamedTuple):
    """Segment ids of the queries [B, Tq] and the keys [B, Tk]."""

    q: jax.Array
    k: jax.Array


class Band(NamedTuple):
    """A sliding window over a step: query i sees key j only if
    distance + i - j < length, where `distance` is the sequence position of
    the step's first query minus that of its first key."""

    length: int
    distance: int = 0

    def sees_nothing(self, keys: int) -> bool:
        """Whether no query of the step is within the window of any of its `keys` keys."""
        return self.distance - (keys - 1) >= self.length


class CallCost(NamedTuple):
    """What one custom call of a kernel costs, as its kernel prices it for the
    planner (`jlong.attention.kernels.KernelSpec.price`)."""

    flops: float
    backward: bool  # a backward-pass call (its own efficiency in the step cost)
    workspace_bytes: int = 0  # device memory the call needs that the compiled program does not show


class StepKernel(Protocol):
    def forward(self, q, k, v, docs: Documents | None, causal: bool, band: Band | None = None): ...

    def backward(self, q, k, v, docs: Documents | None, causal: bool, o, lse, do, band: Band | None = None): ...
