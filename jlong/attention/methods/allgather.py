"""All-gather context parallelism (the Llama 3 paper's and Megatron's
`all_gather` method): the sequence stays sharded over the sp devices, each
device projects q, k and v of its own tokens, gathers every device's keys
and values, and attends its own queries over them.

The sequence is laid out zigzag over the sp devices (`jlong.ops.zigzag`:
device c holds chunks c and 2C-1-c of 2C), so every device has the same
causal work; attention then runs the ring's windows over the gathered keys
(`jlong.attention.ring.gathered_attention`), and the keys' gradients go
back to their devices by reduce-scatter (all-gather's transpose).

Heads are taken U at a time, as UPipe does (`attention.heads_per_stage`,
by default one kv head's query group per stage): a stage gathers only the
kv heads its U query heads use, so the gathered keys and values hold
S x (U / group) heads rather than all of them. Unlike Ulysses, every device
keeps all of a stage's query heads, so U need not be a multiple of sp and
H need not divide over sp. No ring: the sequence spans the sp devices alone.

A projection whose per-token latent is narrower than all the heads' keys
and values (multi-head latent attention: `LatentProjection.moves_latent`)
has the latent gathered instead, once for every stage; each stage
up-projects its heads' keys and values from it.

Sliding windows are a band on the gathered keys: a device visits only the
half chunks within the window's reach (`jlong.attention.sliding`). Where
the window fits in half of a device's chunk, only the neighbours' last
window - 1 keys are in reach, so those layers gather nothing: each device
receives the two halos the ring's sliding path sends (O(window) bytes
rather than the whole sequence's keys).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jlong.attention.methods.base import SequenceParallelMethod, sum_over_head_stages
from jlong.attention.methods.ulysses import StagePlan
from jlong.attention.projection import add_output_bias, project_out
from jlong.attention.sliding import fits_halos
from jlong.errors import JlongError
from jlong.ops.shards import HIDDEN, REPLICATED, TOKENS
from jlong.ops.zigzag import SequenceLayout, shard_token_index

if TYPE_CHECKING:
    from jlong.config import Config


class AllGather(SequenceParallelMethod):
    def default_heads_per_stage(self, config: Config) -> int:
        model = config.model
        return model.num_attention_heads // model.kv_heads  # one kv head per stage

    def stage_step(self, config: Config) -> int:
        return 1

    def granule(self, config: Config) -> tuple[int, str]:
        sp = config.mesh.sp
        if sp == 1:
            return 1, "1"
        return 2 * sp, (f"2 x mesh.sp ({2 * sp}: the all-gather method's zigzag layout cuts the sequence into "
                        "2 x sp chunks)")

    def check(self, config: Config) -> None:
        if config.mesh.ring > 1:
            raise JlongError(f"attention.sp_method=allgather spreads the sequence over mesh.sp alone, but mesh.ring "
                             f"is {config.mesh.ring}: set mesh.ring=1 (fold it into mesh.sp), or use "
                             "attention.sp_method=ulysses with the ring")
        H = config.model.num_attention_heads
        self.check_stage_size(config, self.stage_step(config), f"divide the {H} heads (it is the all-gather method's stage size)")
        super().check(config)

    def layout(self, config: Config) -> SequenceLayout:
        return SequenceLayout(config.mesh.sp)

    def latent_exchange(self, config: Config) -> tuple[str, int] | None:
        if config.mesh.sp == 1:
            return None
        return "the all-gather, per layer", config.model.num_attention_heads

    def attention(self, params, x_BSD, positions_BS, segment_ids_BS, *, projection, heads, kernel, shards,
                  unroll_stages=False, add_to_input=True):
        if projection.sinks:  # refused where it cannot run them, never run without
            self.check_sinks(kernel.impl)
        H, K, U = heads
        run = functools.partial(
            _run_stages, plan=StagePlan(H, K, 1, U), axis=shards.axis("sp"), size=shards.size("sp"),
            projection=projection, kernel=kernel, unroll_stages=unroll_stages, add_to_input=add_to_input,
        )
        run = shards.map(run, (REPLICATED, HIDDEN, TOKENS, TOKENS), HIDDEN)
        return run(params, x_BSD, positions_BS, segment_ids_BS)


def _run_stages(params, x_BsD, positions_Bs, segment_ids_Bs, *, plan, axis, size, projection, kernel, unroll_stages,
                add_to_input):
    """The per-device program: x [B, s, D] (s = S / C) -> x + attention output
    (the output alone without `add_to_input`). U query heads per stage, r kv
    slots, w the kv heads a stage projects."""
    if positions_Bs is None:
        index_s = shard_token_index(x_BsD.shape[1] * size, axis, size, None, 1)  # zigzag over the sp ranks
        positions_Bs = jnp.broadcast_to(index_s, x_BsD.shape[:2])
    gather = functools.partial(_gather_sequence, axis=axis)
    k_segment_ids_BS = gather(segment_ids_Bs)
    U = plan.heads_per_stage
    project = plan.stage_projection(projection, params, positions_Bs)
    # A latent narrower than every stage's keys and values together is gathered once, for all the stages;
    # each stage up-projects its heads from it (a latent's kv heads are its query heads: K = H).
    latent_BS = None
    if axis is not None and not kernel.window and projection.moves_latent(params, plan.num_heads):
        latent_BS = jax.tree.map(gather, projection.latent(params, x_BsD, positions_Bs))

    def stage_output(x_input_BsD, sink_BsD, stage):
        sink_logits_U = projection.sink_logits(params, stage * U, U)  # every device attends all U heads
        if latent_BS is not None:
            q_BsUd, gate_BsUd, sink_BsD = projection.queries(params, x_input_BsD, positions_Bs, (stage * U, U),
                                                             sink_BsD)
            weights, expand = projection.up_projection(params, (stage * U, U))
            o_BsUd = kernel.gathered(q_BsUd, *expand(weights, latent_BS), segment_ids_Bs, k_segment_ids_BS,
                                     sink_logits_U, axis=axis, size=size)
            return project_out(params, o_BsUd, stage * U, U, gate_BsUd), sink_BsD
        q_BsUd, k_Bsrd, v_Bsrd, gate_BsUd, sink_BsD = project(x_input_BsD, sink_BsD, stage)
        if axis is None:
            o_BsUd = kernel.local(q_BsUd, k_Bsrd, v_Bsrd, segment_ids_Bs, sink_logits_U)
        elif kernel.window and fits_halos(x_BsD.shape[1], kernel.window):  # the neighbours' halos, no gather
            o_BsUd = kernel.ring(q_BsUd, k_Bsrd, v_Bsrd, segment_ids_Bs, sink_logits_U, axis=axis, size=size)
        else:
            o_BsUd = kernel.gathered(q_BsUd, gather(k_Bsrd), gather(v_Bsrd), segment_ids_Bs, k_segment_ids_BS,
                                     sink_logits_U, axis=axis, size=size)
        return project_out(params, o_BsUd, stage * U, U, gate_BsUd), sink_BsD

    y_BsD = sum_over_head_stages(stage_output, x_BsD, plan.num_stages, unroll=unroll_stages,
                                 add_to_input=add_to_input)
    return add_output_bias(projection, params, y_BsD)


def _gather_sequence(x_Bs, *, axis):
    """[B, s, ...] of this device -> [B, S, ...] of all sp devices, in device order (None stays None)."""
    if axis is None or x_Bs is None:
        return x_Bs
    return jax.lax.all_gather(x_Bs, axis, axis=1, tiled=True)


ALLGATHER = AllGather("allgather", sinks=True)
