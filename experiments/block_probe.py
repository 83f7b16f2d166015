"""Compiled per-device temporary bytes of single blocks' forward + backward
(attention, MLP, loss) on a sequence-parallel mesh, from XLA's memory
analysis: nothing is allocated. The experiments (upipe_memory, memory_stack)
and tests/test_memory_stack.py use these to show what each memory technique
saves, one block at a time.

Weights are replicated (as they are at compute time, after FSDP gathers
them) and x [1, S, D] is split over sp. `devices` (default: jax's) may be
compile-only GPUs (`jlong.planner.targets.gpu_devices`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jlong.attention.kernels import AttentionKernel
from jlong.config import MeshConfig, ModelConfig
from jlong.model.loss import cross_entropy, output_logits, tiled_cross_entropy
from jlong.ops.shards import HIDDEN, TOKENS
from jlong.attention.projection import ATTENTION_PARAMS
from jlong.families import blocks, family_of
from jlong.model.transformer import ForwardOptions
from jlong.parallel.placement import MeshShards, compute_sharding, make_mesh, replicated


class _Probe:
    def __init__(self, model: ModelConfig, seq_len: int, sp: int, dtype: str, devices=None):
        self.mesh = make_mesh(MeshConfig(sp=sp), (jax.devices() if devices is None else devices)[:sp])
        self.shards = MeshShards(self.mesh)
        self.model, self.dtype = model, dtype
        self.replicated = replicated(self.mesh)
        self.x = jax.ShapeDtypeStruct((1, seq_len, model.hidden_size), dtype, sharding=compute_sharding(self.mesh, HIDDEN))
        self.tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32, sharding=compute_sharding(self.mesh, TOKENS))

    def layer_params(self, names):
        specs = family_of(self.model).layer_params(self.model)
        return {n: self.weight(specs[n].shape) for n in names if n in specs}

    def weight(self, shape):
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=self.replicated)

    def vjp_temp_bytes(self, block, params, *extra) -> int:
        """Temp bytes of block(params, x, *extra)'s forward + backward; the
        cotangent is shaped like x, or a scalar 1 for a scalar block."""

        def forward_backward(params, x, *extra):
            out, pullback = jax.vjp(lambda p, x: block(p, x, *extra), params, x)
            cotangent = jnp.ones_like(out) if out.ndim == 0 else self.shards.constrain(jnp.ones_like(out), HIDDEN)
            return pullback(cotangent)

        compiled = jax.jit(forward_backward).lower(params, self.x, *extra).compile()
        return compiled.memory_analysis().temp_size_in_bytes


def attention_temp_bytes(model: ModelConfig, seq_len: int, sp: int, heads_per_stage: int, dtype="float32") -> int:
    """The attention block (norm, projections, exchanges, kernel, output projection, residual) in UPipe stages of U heads."""
    probe = _Probe(model, seq_len, sp, dtype)
    options = ForwardOptions(
        shards=probe.shards, compute_dtype=dtype, attention=AttentionKernel("blockwise"),
        head_stages=model.num_attention_heads // heads_per_stage,
    )
    block = lambda p, x, positions: blocks.attention(p, x, positions, None, model, options)  # noqa: E731
    return probe.vjp_temp_bytes(block, probe.layer_params(ATTENTION_PARAMS), probe.tokens)


def mlp_temp_bytes(model: ModelConfig, seq_len: int, sp: int, tile: int, dtype="float32", devices=None) -> int:
    """The residual MLP block (RMSNorm, SwiGLU, residual add), tiled when `tile` > 0."""
    probe = _Probe(model, seq_len, sp, dtype, devices)
    options = ForwardOptions(shards=probe.shards, compute_dtype=dtype, mlp_tile=tile)
    block = lambda p, x: blocks.residual_swiglu(p, x, model, options)  # noqa: E731
    return probe.vjp_temp_bytes(block, probe.layer_params(blocks.SWIGLU_PARAMS))


def loss_temp_bytes(model: ModelConfig, seq_len: int, sp: int, tile: int, dtype="float32", devices=None) -> int:
    """Output projection + cross-entropy of the final hidden states, tiled when `tile` > 0."""
    probe = _Probe(model, seq_len, sp, dtype, devices)

    def block(w, x, targets):
        if tile:
            return tiled_cross_entropy(x, w, targets, tile=tile, shards=probe.shards)
        return cross_entropy(output_logits(x, w), targets)

    return probe.vjp_temp_bytes(block, probe.weight((model.hidden_size, model.vocab_size)), probe.tokens)
