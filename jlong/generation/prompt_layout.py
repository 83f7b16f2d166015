"""Prompts of different lengths in one prefill batch, right-aligned.

Row b of a batch of padded length P holds its prompt of n_b tokens at
padded indices P - n_b .. P - 1, positions 0 .. n_b - 1, as document 1; the
padding before it is document 0, which attention, the convolutions and the
linear-attention rule keep apart from the prompt (packed documents, as in
training). Every prompt thus ends at index P - 1: its last hidden state,
a linear-attention layer's final state and its convolution's last inputs
are the sequence's own, and the new tokens of every row go to the same
slots. A cache slot remembers the position it holds (-1: padding), so
decoding never attends the padding.

The arrays travel in the model's layout of the sequence (zigzag over a
ring, `jlong.ops.zigzag`); `slots` is each token's padded index in that
layout, which lets per-device code find given indices among its tokens
(`take_indices`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

PADDING, PROMPT = 0, 1  # the segment ids of the padding and of the prompt


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """[B, P] arrays of a batch of prompts, right-aligned, in sequence order."""

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    lengths: np.ndarray  # [B] each prompt's tokens

    @classmethod
    def of(cls, prompts: list[list[int]], padded_length: int) -> PromptBatch:
        B, P = len(prompts), padded_length
        lengths = np.array([len(p) for p in prompts], np.int32)
        tokens = np.zeros((B, P), np.int32)
        segment_ids = np.full((B, P), PADDING, np.int32)
        positions = np.zeros((B, P), np.int32)
        for b, prompt in enumerate(prompts):
            n = len(prompt)
            tokens[b, P - n:] = prompt
            segment_ids[b, P - n:] = PROMPT
            positions[b, P - n:] = np.arange(n)
        return cls(tokens, positions, segment_ids, lengths)

    @property
    def padded_length(self) -> int:
        return self.tokens.shape[1]

    def slot_positions(self) -> np.ndarray:
        """[B, P] the position each padded index holds, -1 for padding."""
        return np.where(self.segment_ids == PROMPT, self.positions, -1).astype(np.int32)

    def arrays(self) -> dict[str, np.ndarray]:
        """What the prefill program takes, in sequence order: tokens, positions, segment_ids and slots (each
        token's padded index)."""
        slots = np.broadcast_to(np.arange(self.padded_length, dtype=np.int32), self.tokens.shape)
        return {"tokens": self.tokens, "positions": self.positions, "segment_ids": self.segment_ids,
                "slots": np.ascontiguousarray(slots), "slot_positions": self.slot_positions()}


def window_indices(padded_length: int, window: int) -> np.ndarray:
    """[window] the padded index a sliding window's ring buffer holds in each
    slot after the prompt (index i lives in slot i mod window; -1: none yet)."""
    P = padded_length
    held = np.arange(max(0, P - window), P)
    slots = np.full(window, -1, np.int32)
    slots[held % window] = held
    return slots


def take_indices(x_Bs, slots_Bs, wanted_T, axes: tuple[str, ...]):
    """[B, T, ...]: each row's entries of x at the padded indices `wanted_T`
    (-1: zeros), gathered from the devices of mesh `axes` that hold them,
    inside shard_map. `slots_Bs` are the padded indices of this device's
    entries of x [B, s, ...], ascending (true of every layout jlong lays the
    sequence out in)."""
    wanted_T = jnp.asarray(wanted_T)
    found_BT = jax.vmap(lambda row: jnp.searchsorted(row, wanted_T))(slots_Bs)
    found_BT = jnp.clip(found_BT, 0, slots_Bs.shape[1] - 1)
    here_BT = (jnp.take_along_axis(slots_Bs, found_BT, axis=1) == wanted_T) & (wanted_T >= 0)
    taken = jax.vmap(lambda row, index: jnp.take(row, index, axis=0))(x_Bs, found_BT)
    taken = jnp.where(here_BT.reshape(*here_BT.shape, *(1,) * (taken.ndim - 2)), taken, jnp.zeros_like(taken))
    return jax.lax.psum(taken, axes) if axes else taken
