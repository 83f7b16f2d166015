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
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jlong.ops.head_stages import sum_over_head_stages
from jlong.errors import JlongError
from jlong.linear_attention import gated_delta
from jlong.linear_attention.ring import halo, last_tail, ring_rule
from jlong.ops import adapted
from jlong.ops.layers import rms_norm
from jlong.ops.tiling import join_tiles, split_tiles, tiles_gradient_into, varying_like

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
    interpret: bool = False  # a GPU kernel in its interpreter (on the CPU)

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

    def head_plan(self, devices: int, stages: int = 1) -> HeadPlan:
        """Which heads each of `devices` sp devices runs, in up to `stages`
        stages (the most that split its heads evenly and never straddle a key
        head's group); a one-line error when the devices cannot split them."""
        Hk, Hv = self.key_heads, self.value_heads
        if Hv % devices:
            raise JlongError(f"model.linear_num_value_heads ({Hv}) must be divisible by mesh.sp ({devices}) for "
                             "Gated DeltaNet's heads to split over the sp devices")
        per_device, group = Hv // devices, Hv // Hk
        if not _workable(per_device, group):
            raise JlongError(f"mesh.sp ({devices}) splits Gated DeltaNet's {Hv} value heads into {per_device} per "
                             f"device, which straddle the groups of {group} that share a key head; choose an sp "
                             f"degree giving a multiple or a divisor of {group} value heads per device")
        stages = max(n for n in range(1, min(stages, per_device) + 1)
                     if per_device % n == 0 and _workable(per_device // n, group))
        return HeadPlan(Hk, Hv, devices, stages)


def _workable(heads: int, group: int) -> bool:
    """Whether runs of `heads` value heads (aligned to their count) never straddle two key heads' groups."""
    return heads % group == 0 or group % heads == 0


@dataclasses.dataclass(frozen=True)
class HeadPlan:
    """The heads of each device of an sp group of `devices`, in `stages`
    stages (static): device c runs its block of Hv / C value heads,
    Hv / (C x stages) of them per stage, and the key heads they read."""

    key_heads: int
    value_heads: int
    devices: int
    stages: int = 1

    @property
    def value_heads_per_stage(self) -> int:
        """Value heads one device runs in one stage."""
        return self.value_heads // (self.devices * self.stages)

    @property
    def key_slots(self) -> int:
        """Key heads one device holds in one stage (a key head several devices read is copied to each)."""
        return max(1, self.value_heads_per_stage * self.key_heads // self.value_heads)

    def value_heads_of(self) -> np.ndarray:
        """[stages, devices x heads per stage]: each stage's value heads, device-major."""
        per_device, n = self.value_heads // self.devices, self.value_heads_per_stage
        return np.array([[c * per_device + s * n + j for c in range(self.devices) for j in range(n)]
                         for s in range(self.stages)])

    def key_heads_of(self) -> np.ndarray:
        """[stages, devices x key slots]: the key head in each (device, slot) of each stage."""
        group, first = self.value_heads // self.key_heads, self.value_heads_of()[:, ::self.value_heads_per_stage]
        return np.array([[f // group + i for f in firsts for i in range(self.key_slots)] for firsts in first])


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
                             to_heads: Callable, to_sequence: Callable, device, ring=(None, 1), tile: int = 0,
                             keep_state: bool = False):
    """x + Gated DeltaNet(x) for one device's tokens x [B, s, D], summed over
    the plan's head stages; `to_heads` and `to_sequence` exchange [B, s, N, d]
    <-> [B, S, N/C, d] over the sp group (identity on one device); `device`
    is this device's index in it; `segment_ids_BS` are the whole group's
    [B, S] (None: one document); `ring` is (the ring's mesh axis or None,
    its size): with a ring, the group holds its rank's two zigzag chunks
    (`jlong.linear_attention.ring`); `tile`: the tokens of the output's
    norm and projection computed at a time (0: all), as the MLP's.

    With `keep_state` (a sampler's prefill), also what decoding on from the
    sequence's end needs for this device's heads, per stage (`gated_deltanet_step`):
    the rule's final state and the convolution's inputs of the last taps - 1
    tokens (zeros where they belong to an earlier document)."""
    tile = tile or x_BsD.shape[1]
    values_of, keys_of = jnp.asarray(plan.value_heads_of()), jnp.asarray(plan.key_heads_of())
    n, r = plan.value_heads_per_stage, plan.key_slots
    if segment_ids_BS is None:
        segment_ids_BS = jnp.zeros((x_BsD.shape[0], x_BsD.shape[1] * plan.devices), jnp.int32)  # the group's tokens
    rule = gated_delta.rule(layer.kernel, interpret=layer.interpret)

    def stage_output(x_input_BsD, sink_BsD, stage):
        values, keys = values_of[stage], keys_of[stage]
        own_values = jax.lax.dynamic_slice_in_dim(values, device * n, n)
        own_keys = jax.lax.dynamic_slice_in_dim(keys, device * r, r)
        # One projection of the normed input for the stage's heads of every device: q, k, v, b, a and z,
        # a tile at a time, x's gradient added into the stages' sink in place (`tiles_gradient_into`).
        projection = _Projection.of(p, layer, keys, values)
        weights = varying_like(projection.weights, x_input_BsD)

        def normed_projection(w, x_tile, _):
            return adapted.matmul(rms_norm(x_tile, w["norm"], layer.norm_eps), w["proj"], inputs=1)

        tokens = jnp.zeros(x_input_BsD.shape[:2], jnp.int32)
        projected, sink_BsD = tiles_gradient_into(normed_projection, tile, weights, x_input_BsD, tokens, sink_BsD)
        q, k, v, z, b, a = projection.split(projected)
        q, k, v = (to_heads(t) for t in (q, k, v))
        b, a = (to_heads(t)[..., 0] for t in (b, a))
        taps = _own_taps(p, layer, own_keys, own_values)
        g, beta = _decay_and_beta(p, own_values, a, b)
        if ring[0] is None:
            convolved = [_conv_and_silu(t, w, segment_ids_BS) for t, w in zip((q, k, v), taps)]
            o, final_state = rule(*_normed_qk(*convolved[:2]), convolved[2], g, beta, segment_ids_BS)
            tails = [_document_tail(t, segment_ids_BS, taps[0].shape[0] - 1) for t in (q, k, v)]
        else:
            o, final_state, tails = _on_ring(rule, (q, k, v), taps, g, beta, segment_ids_BS, ring)
        o_BsHd = to_sequence(o.astype(x_input_BsD.dtype))
        w_out = adapted.on_inputs(functools.partial(jnp.take, indices=values, axis=0), p["gdn_out"])
        y_BsD = _by_tiles(functools.partial(_gated_output, p, layer, w_out), tile, o_BsHd, z)
        if not keep_state:
            return y_BsD, sink_BsD
        return y_BsD, sink_BsD, _kept(final_state, tails)

    return sum_over_head_stages(stage_output, x_BsD, plan.stages, policy=jax.checkpoint_policies.nothing_saveable,
                                unroll=False, add_to_input=True, kept=keep_state)


def gated_deltanet_step(p, x_B1D, kept: dict, *, layer: GatedDeltaNet, plan: HeadPlan, device):
    """One token per sequence through this device's heads of the layer,
    continuing from `kept` (what `gated_deltanet_on_device` kept, or this
    step's last result): (their part of the layer's output [B, 1, D], the
    residual not added; summed over the sp devices it is the layer's
    output), what they keep now). The recurrent form of the rule: the state
    updated by the token, as `gated_delta.recurrent` does."""
    values_of, keys_of = plan.value_heads_of(), plan.key_heads_of()
    n, r = plan.value_heads_per_stage, plan.key_slots
    outputs, new = [], []
    for stage in range(plan.stages):
        own_values = jax.lax.dynamic_slice_in_dim(jnp.asarray(values_of[stage]), device * n, n)
        own_keys = jax.lax.dynamic_slice_in_dim(jnp.asarray(keys_of[stage]), device * r, r)
        projection = _Projection.of(p, layer, own_keys, own_values)
        normed = rms_norm(x_B1D, projection.weights["norm"], layer.norm_eps)
        q, k, v, z, b, a = projection.split(adapted.matmul(normed, projection.weights["proj"], inputs=1))
        b, a = b[..., 0], a[..., 0]
        taps = _own_taps(p, layer, own_keys, own_values)
        tails = [kept[name][stage] for name in CONV_INPUTS]
        windows = [jnp.concatenate([jnp.swapaxes(tail, 1, 2).astype(t.dtype), t], axis=1)
                   for tail, t in zip(tails, (q, k, v))]  # [B, taps, heads, d]
        q, k, v = (jax.nn.silu(jnp.einsum("btcd,tcd->bcd", w, w_taps))[:, None]
                   for w, w_taps in zip(windows, taps))
        q, k = _normed_qk(q, k)
        g, beta = _decay_and_beta(p, own_values, a, b)
        o, state = gated_delta.recurrent(q, k, v, g, beta, initial_state=kept["state"][stage])
        w_out = adapted.on_inputs(functools.partial(jnp.take, indices=own_values, axis=0), p["gdn_out"])
        outputs.append(_gated_output(p, layer, w_out, o.astype(x_B1D.dtype), z))
        new.append(_kept(state, [w[:, 1:] for w in windows]))
    return sum(outputs), jax.tree.map(lambda *each: jnp.stack(each), *new)


CONV_INPUTS = ("conv_q", "conv_k", "conv_v")  # the convolution's inputs of the last taps - 1 tokens, by stream


def _kept(state_BHkv, tails):
    """What decoding needs of one stage's heads: the rule's state [B, heads, dk, dv] (float32) and the
    convolution's inputs of q, k, v over the last taps - 1 tokens, each [B, heads, taps - 1, d] (heads
    second, as the state's, so that one layout splits every entry over the sp devices)."""
    return {"state": state_BHkv.astype(jnp.float32),
            **{name: jnp.swapaxes(t, 1, 2) for name, t in zip(CONV_INPUTS, tails)}}


def _document_tail(x_BSHd, segment_ids_BS, width: int):
    """The last `width` tokens of x [B, S, heads, d], zeros where they are of an earlier document than the
    last token's (the convolution reads nothing across a document start)."""
    tail = x_BSHd[:, -width:]
    same = segment_ids_BS[:, -width:] == segment_ids_BS[:, -1:]
    return tail * same[..., None, None].astype(tail.dtype)


@dataclasses.dataclass(frozen=True)
class _Projection:
    """One projection of the normed input to q, k, v, z, b and a of some heads:
    each part's matrix [D, heads, d] taken from the layer's, and all of them
    side by side (`weights["proj"]`, [D, N]), with the input norm's weight."""

    parts: tuple  # the parts' matrices, in the order q, k, v, z, b, a
    weights: dict

    @classmethod
    def of(cls, p, layer: GatedDeltaNet, keys, values) -> _Projection:
        """For the key heads `keys` (q's and k's) and the value heads `values` (v's, z's, b's, a's)."""
        w_q, w_k, w_v = adapted.on_outputs(layer.split_heads, p["gdn_qkv"])
        one_head_each = functools.partial(adapted.on_outputs, lambda w: w[..., None])  # [D, Hv] -> [D, Hv, 1]
        matrices = ((w_q, keys), (w_k, keys), (w_v, values), (p["gdn_z"], values),
                    (one_head_each(p["gdn_b"]), values), (one_head_each(p["gdn_a"]), values))
        parts = tuple(adapted.on_outputs(functools.partial(jnp.take, indices=index, axis=1), w)
                      for w, index in matrices)
        flat = [adapted.on_outputs(lambda w: w.reshape(w.shape[0], -1), w) for w in parts]
        return cls(parts, {"norm": p["attn_norm"], "proj": adapted.concatenate(flat, axis=1)})

    def split(self, projected_BsN):
        """[B, s, N] -> q, k, v, z [B, s, heads, d] and b, a [B, s, heads, 1]."""
        widths = [math.prod(w.shape[1:]) for w in self.parts]
        pieces = jnp.split(projected_BsN, np.cumsum(widths)[:-1], axis=-1)
        return tuple(t.reshape(*t.shape[:2], *w.shape[1:]) for t, w in zip(pieces, self.parts))


def _own_taps(p, layer: GatedDeltaNet, own_keys, own_values):
    """The convolution's taps [taps, heads, d] of q's and k's key heads `own_keys` and v's value heads `own_values`."""
    taps_q, taps_k, taps_v = layer.split_heads(p["gdn_conv"])
    return (jnp.take(taps_q, own_keys, axis=1), jnp.take(taps_k, own_keys, axis=1),
            jnp.take(taps_v, own_values, axis=1))


def _decay_and_beta(p, own_values, a, b):
    """The log decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) of the value heads
    `own_values`, in float32 (`a`, `b`: [..., heads])."""
    a_log, dt_bias = (jnp.take(p[name], own_values).astype(jnp.float32) for name in ("gdn_a_log", "gdn_dt_bias"))
    return -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias), jax.nn.sigmoid(b.astype(jnp.float32))


def _gated_output(p, layer: GatedDeltaNet, w_out, o, z):
    """out_proj(norm(o) x SiLU(z)) of some heads, `w_out` their rows of the output projection."""
    gated = rms_norm(o, p["gdn_norm"], layer.norm_eps).astype(jnp.float32)
    gated = (gated * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)
    return adapted.matmul(gated, w_out, inputs=2)


def _by_tiles(fn, tile: int, *arrays):
    """fn of [B, s, ...] arrays, computed on sequence tiles of `tile` tokens one
    after another and joined; the backward pass recomputes a tile at a time,
    so no float32 intermediate spans the shard."""
    if tile == arrays[0].shape[1]:
        return fn(*arrays)
    outputs = jax.lax.map(jax.checkpoint(lambda tiles: fn(*tiles)), tuple(split_tiles(t, tile) for t in arrays))
    return jax.tree.map(join_tiles, outputs)


def _conv_and_silu(x, taps, segment_ids):
    return jax.nn.silu(causal_conv(x, taps, segment_ids))


def _normed_qk(q, k):
    """q and k L2-normalised, q also scaled by dk^-1/2 (in their dtype: the rule reads them in float32)."""
    return (_l2_normed(q) * (q.shape[-1] ** -0.5)).astype(q.dtype), _l2_normed(k).astype(k.dtype)


def _on_ring(rule, qkv, taps, g, beta, segment_ids_BS, ring):
    """(the rule's output [B, S/R, H, dv] for the ring rank's two zigzag
    chunks, the sequence's final state, the convolution's inputs of its last
    taps - 1 tokens): each chunk's convolution continues from the tokens
    before it and its rule from the state before it."""
    axis, size = ring
    pieces = lambda t: t.reshape(t.shape[0], 2, t.shape[1] // 2, *t.shape[2:])  # noqa: E731
    segments = pieces(segment_ids_BS)
    width = taps[0].shape[0] - 1
    convolved, tails = [], []
    for x, w in zip(qkv, taps):
        x = pieces(x)
        before, before_segments = halo(x, segments, width, axis, size)
        joined = jnp.concatenate([before, x], axis=2)
        joined_segments = jnp.concatenate([before_segments, segments], axis=2)
        out = jax.vmap(_conv_and_silu, in_axes=(1, None, 1), out_axes=1)(joined, w, joined_segments)
        convolved.append(out[:, :, width:])
        tail, tail_segments = last_tail(x, segments, width, axis, size)
        tails.append(_document_tail(tail, tail_segments, width))
    q, k, v = convolved
    q, k = _normed_qk(q, k)
    o, final_state = ring_rule(rule, q, k, v, pieces(g), pieces(beta), segments, before_segments[..., -1],
                               axis=axis, size=size)
    return o.reshape(o.shape[0], -1, *o.shape[3:]), final_state, tails


def conv_flops_per_token(layer_channels: int, taps: int) -> float:
    """The convolution's multiply-adds per token, forward (for the planner)."""
    return 2.0 * layer_channels * taps


def rule_flops_per_token(value_heads: int, dk: int, dv: int, chunk: int) -> float:
    """The chunked rule's floating-point work per token, forward, as model
    FLOPs: per value head and chunk of C tokens, the C x C products (q k^T,
    k_beta k^T, the intra-chunk attention times the new values), the
    triangular system applied to widths dk and dv, counted as solves (C^2 x
    width, whatever the kernel inverts it with), and the state's reads and
    update (C x dk x dv three times)."""
    C = chunk
    per_chunk = 2 * C * C * dk * 2 + C * C * (dk + dv) + 2 * C * C * dv + 2 * C * dk * dv * 3
    return value_heads * per_chunk / C
