"""Ulysses context parallelism, run in UPipe head stages.

Each device holds a sequence shard x [B, s, D] with s = S/(R*C) (C = the sp
degree, R = the ring: 1 without ring attention). The sp group of C devices
holds S/R tokens: the whole sequence, or the ring rank's zigzag chunk pair.
The query heads are taken U at a time (a `lax.scan` over H/U stages, so
every stage reuses the same buffers). For each stage:

1. project the stage's q (and the k, v it needs) from the normed local
   shard, tile by tile (the normed shard never exists whole), with RoPE at
   the shard's global positions;
2. all-to-all: [B, s, U, d] -> [B, S/R, U/C, d] (the group's tokens, U/C heads);
3. causal attention over the group's tokens (with a ring, ring attention
   passes the other groups' keys and values around);
4. all-to-all back: [B, S/R, U/C, d] -> [B, s, U, d];
5. add its output projection, o @ Wo[stage heads], into the residual stream
   [B, s, D] (the block returns x + attention), or, for a family that
   normalises attention's output before the residual add, into a sum of its
   own (one more [B, s, D] buffer, paid only by such families).

Attention buffers hold U/C heads per device instead of H/C (U = H is plain
Ulysses). Each stage is rematerialised with a policy that keeps only the
attention output and its log-sum-exp: the backward pass re-projects and
re-exchanges q, k, v one stage at a time, so nothing O(H) but those outputs
lives between the forward and the backward pass.

Grouped-query attention: device c of stage s holds the U/C query heads
starting at s*U + c*U/C. Every run of `local_group` of them shares one kv
head, so the device needs U/C / local_group kv heads. The stage projects the
distinct kv heads it needs once, repeats them into one slot per
(device, kv head) and exchanges them with the same all-to-all; a kv head
shared by several devices is replicated, and autodiff sums the replicas'
gradients. When U < H/K, consecutive stages share a kv head and each stage
projects and exchanges it again: reusing it across stages (a nested loop)
measured worse for memory, since the nested loop's backward keeps its own
[B, s, D] gradient accumulator for x and copies of the saved outputs.

Attention sinks (one logit per query head): device c of stage s attends
the query heads from s*U + c*U/C on, so it takes those heads' logits; their
gradient from each device is its part, summed by the shard_map's transpose.
Wo's bias is added once, after the stages' sum.

Multi-head latent attention across a ring: where the latent (per token) is
narrower than a device's heads' keys and values per stage
(`LatentProjection.moves_latent`), the sp group gathers its tokens' latent
once per layer, only q and the output are exchanged all-to-all, and the ring
moves the latent (`jlong.attention.latent_ring`), each device up-projecting
its own heads from every chunk.

Without a mesh (or with C = 1) the same stages run with no collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from jlong.attention.kernels import AttentionKernel
from jlong.attention.methods.base import SequenceParallelMethod, sum_over_head_stages
from jlong.attention.projection import QKVProjection, add_output_bias, project_out
from jlong.linear_attention.gated_deltanet import gated_deltanet_on_device
from jlong.ops.shards import HIDDEN, REPLICATED, TOKENS, OneDevice, Shards
from jlong.errors import JlongError
from jlong.ops.zigzag import SequenceLayout, shard_token_index

if TYPE_CHECKING:
    from jlong.config import Config

# What a linear-attention layer keeps for decoding (`gated_deltanet_on_device`): per head stage, each device's
# heads' entries, the heads split over the sp devices as Ulysses split them.
KEPT_STATE = ("head_stages", "batch", "sp_heads")

@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Which heads each stage and device work on (all static)."""

    num_heads: int  # H
    num_kv_heads: int  # K
    devices: int  # C, the sp degree
    heads_per_stage: int  # U

    @property
    def num_stages(self) -> int:
        return self.num_heads // self.heads_per_stage

    @property
    def heads_per_device(self) -> int:
        return self.heads_per_stage // self.devices

    @property
    def local_group(self) -> int:
        """Query heads per kv head on one device: runs this long never straddle
        two kv heads, because it divides both H/K and every device's first head."""
        return math.gcd(self.heads_per_device, self.num_heads // self.num_kv_heads)

    @property
    def kv_per_device(self) -> int:
        return self.heads_per_device // self.local_group

    def kv_slots(self, stage: int) -> np.ndarray:
        """Global kv head of each (device, slot) pair, device-major: [C * kv_per_device]."""
        group = self.num_heads // self.num_kv_heads
        first = stage * self.heads_per_stage
        return np.array([
            (first + c * self.heads_per_device + i * self.local_group) // group
            for c in range(self.devices)
            for i in range(self.kv_per_device)
        ])

    @functools.cached_property
    def kv_window(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(width, first head [stages], slot index within the window [stages, C*r]):
        each stage projects `width` consecutive kv heads and repeats them into slots."""
        slots = np.stack([self.kv_slots(s) for s in range(self.num_stages)])
        width = int((slots.max(1) - slots.min(1)).max()) + 1
        first = np.minimum(slots.min(1), self.num_kv_heads - width)
        return width, first, slots - first[:, None]

    def stage_projection(self, projection: QKVProjection, params, positions_Bs, place_kv=lambda t: t):
        """(x, sink, stage) -> (q [B, s, U, d] of the stage's query heads, k and v
        repeated into the stage's kv slots and each passed through `place_kv`,
        the query heads' output gate or None, sink) for one device's tokens."""
        U = self.heads_per_stage
        width, first_kv, slots = self.kv_window
        first_kv, slots = jnp.asarray(first_kv), jnp.asarray(slots)

        def project(x_BsD, sink_BsD, stage):
            q_BsUd, k_Bswd, v_Bswd, gate_BsUd, sink_BsD = projection.qkv(
                params, x_BsD, positions_Bs, (stage * U, U), (first_kv[stage], width), sink_BsD
            )
            k, v = (place_kv(jnp.take(t, slots[stage], axis=2)) for t in (k_Bswd, v_Bswd))
            return q_BsUd, k, v, gate_BsUd, sink_BsD

        return project


def staged_attention(params, x_BSD, positions_BS, segment_ids_BS, *, projection: QKVProjection, heads,
                     kernel: AttentionKernel, shards: Shards = OneDevice(), unroll_stages=False,
                     add_to_input=True):
    """x + self-attention of x [B, S, D] (the projection normalises x first;
    output projection included), in UPipe stages; the attention alone when
    `add_to_input` is False. `params` are the attention
    weights (`jlong.attention.projection`).

    `heads` is (H, K, U). On a mesh (`shards`) this runs per device
    (shard_map) with Ulysses exchanges over the sp mesh axis and, with a
    ring, ring attention over the ring axis on the zigzag layout
    (`jlong.ops.zigzag`); otherwise the same stages run on the whole
    array. Without `positions`, each token's position is its index in the
    sequence.
    """
    H, K, U = heads
    run = functools.partial(
        _run_stages,
        plan=StagePlan(H, K, shards.size("sp"), U),
        sp_axis=shards.axis("sp"),
        ring=(shards.axis("ring"), shards.size("ring")),
        projection=projection,
        kernel=kernel,
        unroll_stages=unroll_stages,
        add_to_input=add_to_input,
    )
    run = shards.map(run, (REPLICATED, HIDDEN, TOKENS, TOKENS), HIDDEN)
    return run(params, x_BSD, positions_BS, segment_ids_BS)


def _run_stages(params, x_BsD, positions_Bs, segment_ids_Bs, *, plan, sp_axis, ring, projection, kernel,
                unroll_stages, add_to_input):
    """The per-device program: x [B, s, D] -> x + attention output [B, s, D]
    (the output alone without `add_to_input`).
    Shape letters: s = S/(R*C) (this device's shard; R the ring, C the sp
    degree), U heads per stage, u = U/C heads per device, r kv slots per
    device, w the kv heads a stage projects."""
    ring_axis, ring_size = ring
    seq_len = x_BsD.shape[1] * plan.devices * ring_size
    if positions_Bs is None:
        index_s = shard_token_index(seq_len, ring_axis, ring_size, sp_axis, plan.devices)
        positions_Bs = jnp.broadcast_to(index_s, x_BsD.shape[:2])
    attend = kernel.local if ring_axis is None else functools.partial(kernel.ring, axis=ring_axis, size=ring_size)
    segment_ids_BS = _gather_sequence(segment_ids_Bs, sp_axis)
    to_heads = functools.partial(_exchange, axis=sp_axis, split=2, concat=1)
    to_sequence = functools.partial(_exchange, axis=sp_axis, split=1, concat=2)
    U, u = plan.heads_per_stage, plan.heads_per_device
    project = plan.stage_projection(projection, params, positions_Bs, place_kv=to_heads)
    device = 0 if sp_axis is None else jax.lax.axis_index(sp_axis)
    # Across a ring, a latent narrower than a device's heads' keys and values per stage travels instead: the
    # sp group's tokens of it, gathered once for all the stages (it is per token, the same for every head);
    # each device up-projects its own heads from every chunk that arrives (K = H for a latent).
    latent_BS = None
    if ring_axis is not None and not kernel.window and projection.moves_latent(params, u):
        latent_BS = jax.tree.map(functools.partial(_gather_sequence, axis=sp_axis),
                                 projection.latent(params, x_BsD, positions_Bs))

    def latent_stage_output(x_input_BsD, sink_BsD, stage):
        q_BsUd, gate_BsUd, sink_BsD = projection.queries(params, x_input_BsD, positions_Bs, (stage * U, U),
                                                         sink_BsD)
        weights, expand = projection.up_projection(params, (stage * U + device * u, u))  # this device's heads
        o_BSud = kernel.latent_ring(to_heads(q_BsUd), latent_BS, weights, expand, segment_ids_BS, axis=ring_axis,
                                    size=ring_size)
        return project_out(params, to_sequence(o_BSud), stage * U, U, gate_BsUd), sink_BsD

    def stage_output(x_input_BsD, sink_BsD, stage):
        if latent_BS is not None:
            return latent_stage_output(x_input_BsD, sink_BsD, stage)
        q_BsUd, k_BSrd, v_BSrd, gate_BsUd, sink_BsD = project(x_input_BsD, sink_BsD, stage)
        sink_logits_u = projection.sink_logits(params, stage * U + device * u, u)  # this device's heads
        o_BSud = attend(to_heads(q_BsUd), k_BSrd, v_BSrd, segment_ids_BS, sink_logits_H=sink_logits_u)
        return project_out(params, to_sequence(o_BSud), stage * U, U, gate_BsUd), sink_BsD

    y_BsD = sum_over_head_stages(stage_output, x_BsD, plan.num_stages, unroll=unroll_stages,
                                 add_to_input=add_to_input)
    return add_output_bias(projection, params, y_BsD)


def _gather_sequence(x_Bs, axis):
    """[B, s] per-token values -> [B, S/R] of the sp group (None stays None)."""
    if axis is None or x_Bs is None:
        return x_Bs
    return jax.lax.all_gather(x_Bs, axis, axis=1, tiled=True)


def _exchange(x, *, axis, split, concat):
    """all-to-all over the sp axis (identity without one)."""
    if axis is None:
        return x
    return jax.lax.all_to_all(x, axis, split, concat, tiled=True)


class Ulysses(SequenceParallelMethod):
    """Heads exchanged all-to-all within the sp group, in UPipe stages of U
    heads; with a ring, ring attention across the sp groups."""

    def default_heads_per_stage(self, config: Config) -> int:
        return config.mesh.sp  # one head per device per stage: UPipe's smallest stage

    def stage_step(self, config: Config) -> int:
        return config.mesh.sp  # every device takes the same number of each stage's heads

    def granule(self, config: Config) -> tuple[int, str]:
        sp, ring = config.mesh.sp, config.mesh.ring
        if ring == 1:
            return sp, f"mesh.sp ({sp})"
        granule = 2 * ring * sp
        return granule, (f"2 x mesh.ring x mesh.sp ({granule}: the zigzag layout cuts the sequence into "
                         "2 x ring chunks, each split over sp)")

    def check(self, config: Config) -> None:
        H, sp = config.model.num_attention_heads, config.mesh.sp
        if H % sp:  # first: no sequence length helps heads that sp cannot split
            workable = [c for c in range(1, H + 1) if H % c == 0]
            raise JlongError(f"model.num_attention_heads ({H}) is not divisible by mesh.sp ({sp}); "
                             f"sp degrees that work: {', '.join(map(str, workable))}")
        self.check_stage_size(config, sp, f"be a multiple of mesh.sp ({sp}) that divides the {H} heads")
        super().check(config)

    def layout(self, config: Config) -> SequenceLayout:
        return SequenceLayout(config.mesh.ring)

    def latent_exchange(self, config: Config) -> tuple[str, int] | None:
        if config.mesh.ring == 1:  # Ulysses exchanges the up-projected heads
            return None
        return "the ring, per stage", self.heads_per_stage(config) // config.mesh.sp

    def check_linear_attention(self, config: Config, layer) -> None:
        layer.head_plan(config.mesh.sp)

    def linear_attention(self, params, x_BSD, segment_ids_BS, *, layer, shards, tile=0, stages=1,
                         keep_state=False):
        """x + the linear-attention layer of x: its heads exchanged all-to-all
        over sp, each device running the sp group's tokens for its heads;
        with a ring, the state and the convolution's halo passed between
        the ring's ranks (`jlong.linear_attention.ring`). With `keep_state`,
        (that, what decoding on needs of each device's heads: `KEPT_STATE`)."""
        sp_axis, ring = shards.axis("sp"), (shards.axis("ring"), shards.size("ring"))
        plan = layer.head_plan(shards.size("sp"), stages)
        to_heads = functools.partial(_exchange, axis=sp_axis, split=2, concat=1)
        to_sequence = functools.partial(_exchange, axis=sp_axis, split=1, concat=2)

        def run(params, x_BsD, segment_ids_Bs):
            device = 0 if sp_axis is None else jax.lax.axis_index(sp_axis)
            out = gated_deltanet_on_device(params, x_BsD, _gather_sequence(segment_ids_Bs, sp_axis), layer=layer,
                                           plan=plan, to_heads=to_heads, to_sequence=to_sequence, device=device,
                                           ring=ring, tile=tile, keep_state=keep_state)
            if keep_state and "ring" in shards.mesh_axes:  # the same on every ring rank: one value of the ring
                y_BsD, kept = out
                return y_BsD, jax.tree.map(lambda x: jax.lax.pmax(x, "ring"), kept)  # the max of equals is each
            return out

        out_axes = (HIDDEN, KEPT_STATE) if keep_state else HIDDEN
        return shards.map(run, (REPLICATED, HIDDEN, TOKENS), out_axes)(params, x_BSD, segment_ids_BS)

    def attention(self, params, x_BSD, positions_BS, segment_ids_BS, *, projection, heads, kernel, shards,
                  unroll_stages=False, add_to_input=True):
        return staged_attention(params, x_BSD, positions_BS, segment_ids_BS, projection=projection, heads=heads,
                                kernel=kernel, shards=shards, unroll_stages=unroll_stages, add_to_input=add_to_input)


ULYSSES = Ulysses("ulysses", sinks=True)
