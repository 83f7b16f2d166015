"""Head stages (UPipe): a token mixer's heads taken a few at a time, each
stage rematerialised, their outputs summed into the residual stream, so
nothing O(heads) but what a stage's policy keeps lives between the forward
and the backward pass. Attention's stages (`jlong.attention.methods`) and
Gated DeltaNet's (`jlong.linear_attention.gated_deltanet`) share it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def sum_over_head_stages(stage_output, x_BsD, num_stages: int, *, policy, unroll: bool, add_to_input: bool,
                         kept: bool = False):
    """Sum over stages of stage_output(x, sink, stage) -> (out [B, s, D], sink),
    added into x itself (`add_to_input`) or into a zero-filled sum; each
    stage is rematerialised keeping what the checkpoint `policy` saves.
    With `kept`, stage_output also returns what a stage keeps (a sampler's
    state of its heads: `jlong.generation`), and the result is (the sum,
    what each stage kept, stacked over the stages).

    The projections read x without differentiating it; the stages pass a
    gradient sink along instead (x's value, otherwise unused), into whose
    gradient each stage's backward pass adds its part of x's gradient in
    place (`jlong.attention.projection`): one [B, s, D] sum over the stages,
    with no per-stage gradient of x beside it.
    """
    x_input_BsD = jax.lax.stop_gradient(x_BsD)

    # The stream y goes in and out of the checkpointed stage so the stage
    # output is added in place; the backward pass needs no copy of it.
    @functools.partial(jax.checkpoint, policy=policy)
    def add_stage(carry, stage):
        y_BsD, sink_BsD = carry
        out_BsD, sink_BsD, *keep = stage_output(x_input_BsD, sink_BsD, stage)
        return (y_BsD + out_BsD, sink_BsD), (keep[0] if kept else None)

    # With `add_to_input` the stages add into the residual stream itself (no
    # zero-filled sum, which XLA would share between the forward and backward
    # pass and keep alive in between), in the compute dtype: a float32 sum
    # would be the largest buffer of the layer at long context, for the
    # rounding of a handful of additions.
    #
    # Unrolled, each stage's saved attention output is a value of the layer
    # itself rather than a slice of the stage loop's stacked residual: the
    # layer's remat policy can then move it to host memory, which XLA:GPU
    # (jax 0.10.2) fails to compile for a residual stacked by a loop nested
    # in the layer loop. The scan plans 1.3 GiB less per device (Llama3-8B,
    # 1M tokens), so it stays the default.
    carry = (x_BsD if add_to_input else jnp.zeros_like(x_BsD), x_BsD)
    if unroll:
        keeps = []
        for stage in range(num_stages):
            carry, keep = add_stage(carry, stage)
            keeps.append(keep)
        y_BsD, keeps = carry[0], (jax.tree.map(lambda *each: jnp.stack(each), *keeps) if kept else None)
    else:
        (y_BsD, _), keeps = jax.lax.scan(add_stage, carry, jnp.arange(num_stages))
    return (y_BsD, keeps) if kept else y_BsD
