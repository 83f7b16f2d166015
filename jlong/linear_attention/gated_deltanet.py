"""Gated DeltaNet, Qwen3.5's linear-attention layer, on one device's shard.

From the normed residual stream h: q, k [Hk heads of dk] and v [Hv heads of
dv] by one projection each, then a depthwise causal convolution of
`conv_kernel` taps over each of their channels with SiLU; q and k
L2-normalised (q also scaled by dk^-1/2); beta = sigmoid(h Wb) and the log
decay g = -exp(A_log) softplus(h Wa + dt_bias) per value head; the gated
delta rule (`jlong.linear_attention.gated_delta`), where value head j reads
key head j // (Hv / Hk); each head's output RMS-normed, times SiLU(h Wz);
and the output projection.

Heads are independent, as attention's are, so Ulysses serves the layer
unchanged: after an all-to-all each device holds the whole sequence (of its
sp group) for its value heads and the key heads they read, runs the
convolution and the rule there, and exchanges the outputs back. When a key
head serves value heads on several devices, each of them gets a copy of it
(autodiff sums the copies' gradients), as Ulysses does for kv heads.

Packed documents: the convolution never reaches across a document start and
the rule starts each document from a zero state.

Parameters by name: `attn_norm`; `gdn_qkv` [D, N] and `gdn_conv` [taps, N]
with their N = 2 Hk dk + Hv dv channels in Hugging Face's order (q's heads,
k's, v's); `gdn_z` [D, Hv, dv]; `gdn_b`, `gdn_a` [D, Hv]; `gdn_a_log`,
`gdn_dt_bias` [Hv]; `gdn_norm` [dv]; `gdn_out` [Hv, dv, D].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jlong.errors import JlongError
from jlong.linear_attention.gated_delta import KERNELS
from jlong.linear_attention.ring import halo, ring_rule
from jlong.ops.layers import rms_norm

LINEAR_ATTENTION = "linear_attention"  # Hugging Face's name for these layers in `layer_types`
GDN_PARAMS = ("attn_norm", "gdn_qkv", "gdn_conv", "gdn_z", "gdn_b", "gdn_a", "gdn_a_log", "gdn_dt_bias", "gdn_norm",
              "gdn_out")
L2_EPS = 1e-6  # inside the square root of q's and k's L2 norms, as Hugging Face and FLA compute them


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    """One Gated DeltaNet layer's shape and settings (all static)."""

    key_heads: int  # Hk
    value_heads: int  # Hv, a multiple of Hk
    key_dim: int  # dk
    value_dim: int  # dv
    norm_eps: float  # of the input RMSNorm and the per-head output norm
    kernel: str = "chunked"  # `gated_delta.KERNELS`

    @property
    def channels(self) -> int:
        """q's, k's and v's channels together (the convolution's)."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def split_heads(self, x):
        """[..., channels] -> q, k [..., Hk, dk] and v [..., Hv, dv]."""
        Hk, dk = self.key_heads, self.key_dim
        q, k, v = jnp.split(x, [Hk * dk, 2 * Hk * dk], axis=-1)
        heads = lambda t, n, d: t.reshape(*t.shape[:-1], n, d)  # noqa: E731
        return heads(q, Hk, dk), heads(k, Hk, dk), heads(v, self.value_heads, self.value_dim)

    def head_plan(self, devices: int) -> HeadPlan:
        """Which heads each of `devices` sp devices runs; a one-line error when they cannot split them."""
        Hk, Hv = self.key_heads, self.value_heads
        if Hv % devices:
            raise JlongError(f"model.linear_num_value_heads ({Hv}) must be divisible by mesh.sp ({devices}) for "
                             "Gated DeltaNet's heads to split over the sp devices")
        per_device, group = Hv // devices, Hv // Hk
        if per_device % group and group % per_device:
            raise JlongError(f"mesh.sp ({devices}) splits Gated DeltaNet's {Hv} value heads into {per_device} per "
                             f"device, which straddle the groups of {group} that share a key head; choose an sp "
                             f"degree giving a multiple or a divisor of {group} value heads per device")
        return HeadPlan(Hk, Hv, devices)


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The heads of one device in an sp group of `devices` (static)."""

    key_heads: int
    value_heads: int
    devices: int

    @property
    def value_heads_per_device(self) -> int:
        return self.value_heads // self.devices

    @property
    def key_slots(self) -> int:
        """Key heads each device holds (a key head some devices share is copied to each)."""
        return max(1, self.value_heads_per_device * self.key_heads // self.value_heads)

    def key_heads_of(self) -> np.ndarray:
        """The key head in each (device, slot), device-major: [devices * key_slots]."""
        group = self.value_heads // self.key_heads
        return np.array([c * self.value_heads_per_device // group + i
                         for c in range(self.devices) for i in range(self.key_slots)])


def causal_conv(x_BSCd, taps_KCd, segment_ids_BS):
    """Depthwise causal convolution along the sequence: out_t = sum_j w[K-1-j] x_{t-j},
    counting only the x_{t-j} of t's own document."""
    K, S = taps_KCd.shape[0], x_BSCd.shape[1]
    out = x_BSCd * taps_KCd[K - 1]
    for j in range(1, min(K, S)):
        earlier = jnp.pad(x_BSCd[:, :-j], [(0, 0), (j, 0), (0, 0), (0, 0)])
        if segment_ids_BS is not None:
            same = segment_ids_BS[:, j:] == segment_ids_BS[:, :-j]
            earlier = earlier * jnp.pad(same, [(0, 0), (j, 0)])[..., None, None].astype(x_BSCd.dtype)
        out = out + earlier * taps_KCd[K - 1 - j]
    return out


def _l2_normed(x):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2_EPS)


def gated_deltanet_on_device(p, x_BsD, segment_ids_BS, *, layer: GatedDeltaNet, plan: HeadPlan,
                             to_heads: Callable, to_sequence: Callable, device, ring=(None, 1)):
    """x + Gated DeltaNet(x) for one device's tokens x [B, s, D]; `to_heads`
    and `to_sequence` exchange [B, s, N, d] <-> [B, S, N/C, d] over the sp
    group (identity on one device); `device` is this device's index in it;
    `segment_ids_BS` are the whole group's [B, S] (None: one document);
    `ring` is (the ring's mesh axis or None, its size): with a ring, the
    group holds its rank's two zigzag chunks (`jlong.linear_attention.ring`)."""
    dtype = x_BsD.dtype
    h_BsD = rms_norm(x_BsD, p["attn_norm"], layer.norm_eps)
    project = lambda w: jnp.einsum("bsd,d...->bs...", h_BsD, w)  # noqa: E731
    slots = jnp.asarray(plan.key_heads_of().reshape(plan.devices, plan.key_slots))[device]
    hv = plan.value_heads_per_device

    def own_values(w, axis):  # this device's value heads of a per-head parameter
        return jax.lax.dynamic_slice_in_dim(w, device * hv, hv, axis)

    q, k, v = layer.split_heads(project(p["gdn_qkv"]))
    global_slots = jnp.asarray(plan.key_heads_of())
    q, k = (to_heads(jnp.take(t, global_slots, axis=2)) for t in (q, k))
    v = to_heads(v)
    b, a = (to_heads(project(p[name])[..., None])[..., 0] for name in ("gdn_b", "gdn_a"))
    taps_q, taps_k, taps_v = layer.split_heads(p["gdn_conv"])
    taps = (jnp.take(taps_q, slots, axis=1), jnp.take(taps_k, slots, axis=1), own_values(taps_v, 1))
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    a_log, dt_bias = own_values(p["gdn_a_log"], 0), own_values(p["gdn_dt_bias"], 0)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    if segment_ids_BS is None:
        segment_ids_BS = jnp.zeros(v.shape[:2], jnp.int32)
    rule = KERNELS[layer.kernel]
    if ring[0] is None:
        q, k, v = (_conv_and_silu(t, w, segment_ids_BS) for t, w in zip((q, k, v), taps))
        o, _ = rule(*_normed_qk(q, k), v, g, beta, segment_ids_BS)
    else:
        o = _on_ring(rule, (q, k, v), taps, g, beta, segment_ids_BS, ring)
    o_BsHd = to_sequence(o.astype(dtype))

    gated = rms_norm(o_BsHd, p["gdn_norm"], layer.norm_eps).astype(jnp.float32)
    gated = (gated * jax.nn.silu(project(p["gdn_z"]).astype(jnp.float32))).astype(dtype)
    return x_BsD + jnp.einsum("bshk,hkd->bsd", gated, p["gdn_out"])


def _conv_and_silu(x, taps, segment_ids):
    return jax.nn.silu(causal_conv(x, taps, segment_ids))


def _normed_qk(q, k):
    """q and k L2-normalised, q also scaled by dk^-1/2."""
    return _l2_normed(q) * (q.shape[-1] ** -0.5), _l2_normed(k)


def _on_ring(rule, qkv, taps, g, beta, segment_ids_BS, ring):
    """The rule's output [B, S/R, H, dv] for the ring rank's two zigzag
    chunks: each chunk's convolution continues from the tokens before it and
    its rule from the state before it."""
    axis, size = ring
    pieces = lambda t: t.reshape(t.shape[0], 2, t.shape[1] // 2, *t.shape[2:])  # noqa: E731
    segments = pieces(segment_ids_BS)
    width = taps[0].shape[0] - 1
    convolved = []
    for x, w in zip(qkv, taps):
        x = pieces(x)
        before, before_segments = halo(x, segments, width, axis, size)
        joined = jnp.concatenate([before, x], axis=2)
        joined_segments = jnp.concatenate([before_segments, segments], axis=2)
        out = jax.vmap(_conv_and_silu, in_axes=(1, None, 1), out_axes=1)(joined, w, joined_segments)
        convolved.append(out[:, :, width:])
    q, k, v = convolved
    q, k = _normed_qk(q, k)
    o = ring_rule(rule, q, k, v, pieces(g), pieces(beta), segments, before_segments[..., -1], axis=axis, size=size)
    return o.reshape(o.shape[0], -1, *o.shape[3:])


def conv_flops_per_token(layer_channels: int, taps: int) -> float:
    """The convolution's multiply-adds per token, forward (for the planner)."""
    return 2.0 * layer_channels * taps


def rule_flops_per_token(value_heads: int, dk: int, dv: int, chunk: int) -> float:
    """The chunked rule's floating-point work per token, forward: per value head
    and chunk of C tokens, the C x C products and triangular solves (q k^T,
    k_beta k^T, two solves of width dk and dv) and the state's reads and
    update (C x dk x dv three times)."""
    C = chunk
    per_chunk = 2 * C * C * dk * 2 + C * C * (dk + dv) + 2 * C * C * dv + 2 * C * dk * dv * 3
    return value_heads * per_chunk / C
