"""The prefill: a batch of prompts through the training forward, keeping
what decoding needs of every layer.

`PrefillLayers` is the model's `LayerIO` for it: each layer runs with a
`CachingMethod` around the run's own sequence-parallel method, so the
attention is the training program's own (Ulysses with head stages, ring,
Ulysses x ring, all-gather; cuDNN or the blockwise kernel; sinks; sliding
windows), and beside it the method keeps:

- an attention layer: its keys and values (after RoPE), projected from the
  same normed input by the same projection, in the batch's layout and
  sharded as the sequence is: a long prompt's cache never sits whole on one
  device. A sliding-window layer keeps only the last `window` tokens, in a
  ring buffer (`prompt_layout.window_indices`), whole on each device;
- a linear-attention (Gated DeltaNet) layer: each device's heads' final
  state and last convolution inputs, from the chunked rule itself
  (`keep_state`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jlong.attention.methods import SequenceParallelMethod
from jlong.generation.prompt_layout import take_indices, window_indices
from jlong.ops.shards import REPLICATED, TOKENS

KV_AXES = ("batch", "seq", "kv_heads", "head_dim")  # [B, S, K, d] keys or values, sharded as the sequence
WINDOW_AXES = ("batch", "window", "kv_heads", "head_dim")  # [B, W, K, d]: a window's buffer, whole on each device


def sequence_axes(shards) -> tuple[str, ...]:
    """The mesh axes the sequence is split over (a reduction over them, even of one device, makes a value
    whole on the mesh)."""
    return tuple(axis for axis in ("ring", "sp") if axis in shards.mesh_axes)


@dataclasses.dataclass
class PrefillLayers:
    """The prefill's `LayerIO`: nothing in, each layer's cache entries out."""

    slots_BP: Any  # each token's padded index, in the batch's layout (`prompt_layout`)
    padded_length: int
    inputs: dict = dataclasses.field(default_factory=dict)

    def method_for(self, options, inputs) -> CachingMethod:
        return CachingMethod(options.sequence_parallel, self)


class CachingMethod:
    """A layer's sequence-parallel method that also keeps its cache entries in `written`."""

    def __init__(self, method: SequenceParallelMethod, layers: PrefillLayers):
        self.method, self.layers = method, layers
        self.written = None

    def attention(self, params, x_BSD, positions_BS, segment_ids_BS, *, projection, heads, kernel, shards,
                  unroll_stages=False, add_to_input=True):
        y_BSD = self.method.attention(params, x_BSD, positions_BS, segment_ids_BS, projection=projection,
                                      heads=heads, kernel=kernel, shards=shards, unroll_stages=unroll_stages,
                                      add_to_input=add_to_input)
        self.written = _cache_entries(params, x_BSD, positions_BS, self.layers, projection=projection,
                                      kv_heads=heads[1], window=kernel.window, shards=shards)
        return y_BSD

    def linear_attention(self, params, x_BSD, segment_ids_BS, *, layer, shards, tile=0, stages=1):
        y_BSD, self.written = self.method.linear_attention(params, x_BSD, segment_ids_BS, layer=layer, shards=shards,
                                                           tile=tile, stages=stages, keep_state=True)
        return y_BSD


def _cache_entries(params, x_BSD, positions_BS, layers: PrefillLayers, *, projection, kv_heads: int, window: int,
                   shards) -> dict:
    """{"k", "v"}: the layer's keys and values after RoPE, [B, P, K, d] as
    the sequence is laid out, or for a sliding window its ring buffer
    [B, window, K, d]."""
    axes = sequence_axes(shards)
    wanted = window_indices(layers.padded_length, window) if window else None

    def per_device(params, x_BsD, positions_Bs, slots_Bs):
        _, k_BsKd, v_BsKd, _, _ = projection.qkv(params, x_BsD, positions_Bs, (0, 1), (0, kv_heads), x_BsD)
        if window:
            return tuple(take_indices(t, slots_Bs, wanted, axes) for t in (k_BsKd, v_BsKd))
        return k_BsKd, v_BsKd

    out = WINDOW_AXES if window else KV_AXES
    k, v = shards.map(per_device, (REPLICATED, TOKENS, TOKENS, TOKENS), (out, out))(
        params, x_BSD, positions_BS, layers.slots_BP)
    return {"k": k, "v": v}


def last_hidden(hidden_BSD, slots_BS, padded_length: int, shards):
    """[B, D] the hidden state at padded index P - 1 (every prompt's last token), whole on each device."""
    axes = sequence_axes(shards)

    def per_device(h_BsD, slots_Bs):
        return take_indices(h_BsD, slots_Bs, np.array([padded_length - 1]), axes)[:, 0]

    return shards.map(per_device, (("batch", "seq", "embed"), TOKENS), ("batch", "embed"))(hidden_BSD, slots_BS)


def window_slot_positions(slot_positions_BP: np.ndarray, window: int) -> np.ndarray:
    """[B, window] the position each slot of a window's ring buffer holds after the prompt (-1: none)."""
    wanted = window_indices(slot_positions_BP.shape[1], window)
    return np.where(wanted >= 0, slot_positions_BP[:, np.maximum(wanted, 0)], -1).astype(np.int32)
