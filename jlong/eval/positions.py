"""Loss by position: does a token late in its context get predicted better than an early one?

Positions are where each token sits in what attention sees: its index in the
sequence, or with packed documents (`data.eos_id`) its index in its
document. Buckets are powers of two: [0, 1), [1, 2), [2, 4), ... up to
train.seq_len; empty ones are left out, so the token-weighted mean of the
buckets is the whole loss.
"""

from __future__ import annotations

import numpy as np


def bucket_edges(seq_len: int) -> list[int]:
    edges = [0] + [1 << k for k in range(seq_len.bit_length()) if 1 << k < seq_len]
    return edges + [seq_len]


def loss_by_position(losses: np.ndarray, positions: np.ndarray, seq_len: int) -> list[dict]:
    """[{start, end, tokens, loss}] of the tokens whose position is in [start, end)."""
    losses, positions = np.asarray(losses, np.float64).ravel(), np.asarray(positions).ravel()
    buckets = []
    edges = bucket_edges(seq_len)
    for start, end in zip(edges[:-1], edges[1:]):
        inside = (positions >= start) & (positions < end)
        if inside.any():
            loss = float(losses[inside].mean())
            buckets.append({"start": start, "end": end, "tokens": int(inside.sum()), "loss": loss})
    return buckets
