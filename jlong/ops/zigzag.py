"""The zigzag layout of the sequence over a ring of R devices.

Causal attention gives late tokens more work than early ones, so a ring
holding the sequence in order would keep its first devices idle. Cut into
2R equal chunks, the sequence is laid out as chunk 0, 2R-1, 1, 2R-2, ...:
ring rank r holds chunks r and 2R-1-r, one early and one late, and every
rank has the same causal work. Only the layout changes: each device knows
its tokens' indices in the sequence (`shard_token_index`), which the
default positions use; ring attention knows which halves of a chunk see
which (`jlong.attention.ring`); and the loss, a mean over tokens, does not
depend on their order.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def chunk_order(ring: int) -> np.ndarray:
    """The 2R chunks of the sequence in the order the layout holds them."""
    return np.array([c for r in range(ring) for c in (r, 2 * ring - 1 - r)])


def chunk_token_index(rank, ring: int, seq_len: int):
    """[seq_len / R] int32: the sequence indices of ring rank `rank`'s tokens
    (a traced rank works: no index array of the sequence's length is a
    constant of the program)."""
    return _zigzag_index(rank, ring, seq_len, jnp.arange(seq_len // ring, dtype=jnp.int32))


def _zigzag_index(rank, ring: int, seq_len: int, in_chunk):
    """Sequence indices of positions `in_chunk` within ring rank `rank`'s chunk."""
    half = seq_len // (2 * ring)
    chunk = jnp.where(in_chunk < half, rank, 2 * ring - 1 - rank)
    return chunk * half + in_chunk % half


@dataclasses.dataclass(frozen=True)
class SequenceLayout:
    """How [B, S, ...] arrays are laid out along the sequence for the model:
    in order (`ranks` 1), or zigzag over `ranks` devices (a ring's, or the
    sp devices of the all-gather method). The batch is laid out where it
    is placed on the mesh (`jlong.program.train_program.TrainProgram.place_batch`),
    and per-token results are restored wherever they come back."""

    ranks: int = 1

    def lay_out(self, x_BS):
        """x in the layout (None stays None)."""
        return self._permute_chunks(x_BS, chunk_order(self.ranks))

    def restore(self, x_BS):
        """x back in sequence order."""
        return self._permute_chunks(x_BS, np.argsort(chunk_order(self.ranks)))

    def _permute_chunks(self, x_BS, order):
        if self.ranks == 1 or x_BS is None:
            return x_BS
        B, S = x_BS.shape[:2]
        chunks = x_BS.reshape(B, 2 * self.ranks, S // (2 * self.ranks), *x_BS.shape[2:])
        return chunks.take(order, axis=1).reshape(x_BS.shape)  # numpy or jax, as x is


def shard_token_index(seq_len: int, ring_axis: str | None, ring: int, sp_axis: str | None, sp: int):
    """[S / (ring x sp)] int32: the sequence indices of this device's tokens,
    inside `shard_map` over the ring and sp axes (either may be absent)."""
    shard = seq_len // (ring * sp)
    sp_rank = 0 if sp_axis is None else jax.lax.axis_index(sp_axis)
    in_chunk = sp_rank * shard + jnp.arange(shard, dtype=jnp.int32)
    if ring_axis is None:
        return in_chunk
    return _zigzag_index(jax.lax.axis_index(ring_axis), ring, seq_len, in_chunk)
