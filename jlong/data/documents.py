"""`data.sampling: documents`: sequences packed from whole documents.

Each document of the token file (from its index, `OUT.documents.npy`, or
found by its end ids) is cut into pieces of at most S + 1 tokens (S =
train.seq_len): a document longer than that becomes whole windows and a
shorter tail. A pass over the corpus ("epoch") draws the pieces in a seeded
order; a full-length piece is a sequence by itself, and the shorter pieces
are packed end to end into sequences of S + 1 tokens (attention and RoPE
restart at every end id, `data.eos_id`), the last one carried into the
next sequence where it does not fit. Sequences follow the order of their
first piece. Pieces of documents of at least S tokens are drawn
`data.long_document_weight` times as often (a fractional weight is rounded
up or down per piece, once per run), as long-context data recipes up-sample
long documents.

Sequence i is a function of i and the seed alone, so a resumed run reads
exactly the batches it would have read.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from jlong.data.corpus import RowSampler, TokenCorpus
from jlong.errors import JlongError


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One pass: `full` pieces' starts, and the packed stream of the short pieces in their drawn order."""

    order: np.ndarray  # each sequence: index into `full_starts` (>= 0) or -1 - (packed sequence number)
    full_starts: np.ndarray
    packed_starts: np.ndarray  # the short pieces in stream order
    packed_ends: np.ndarray  # cumulative stream length after each short piece


class PackedDocuments(RowSampler):
    """The [B, S + 1] token rows of each step, packed from whole documents."""

    def __init__(self, tokens: TokenCorpus, *, seq_len: int, batch_size: int, seed: int, eos_id: int,
                 long_document_weight: float = 1.0):
        S, self.batch_size, self.seed = seq_len, batch_size, seed
        self.tokens, self.width = tokens, S + 1
        starts = tokens.document_starts(eos_id)
        lengths = np.diff(np.append(starts, len(tokens)))
        pieces = -(-lengths // self.width)  # ceil
        doc = np.repeat(np.arange(len(starts)), pieces)
        within = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        self.piece_starts = starts[doc] + within * self.width
        self.piece_lengths = np.minimum(self.width, lengths[doc] - within * self.width)
        weight = long_document_weight
        long = lengths[doc] >= S
        draws = np.random.default_rng([self.seed, 0x10_4D0C]).random(len(doc))
        repeats = np.where(long, np.floor(weight) + (draws < weight - np.floor(weight)), 1).astype(np.int64)
        self.drawn = np.repeat(np.arange(len(doc)), repeats)
        full = self.piece_lengths[self.drawn] == self.width
        self.per_epoch = int(full.sum()) + int(self.piece_lengths[self.drawn[~full]].sum()) // self.width
        if not self.per_epoch:
            raise JlongError(f"{tokens.named} holds {len(tokens)} tokens, fewer than one sequence of "
                             f"train.seq_len + 1 = {self.width}")
        self.long_documents = int((lengths >= S).sum())

    @functools.lru_cache(maxsize=2)
    def epoch(self, number: int) -> Epoch:
        drawn = self.drawn[np.random.default_rng([self.seed, number]).permutation(len(self.drawn))]
        full = self.piece_lengths[drawn] == self.width
        short = drawn[~full]
        packed_ends = np.cumsum(self.piece_lengths[short])
        packed_count = int(packed_ends[-1]) // self.width if len(short) else 0
        # Each sequence's first piece's place in the draw: a full piece's own; a packed sequence's, the
        # piece holding its first token.
        full_place = np.flatnonzero(full)
        first_piece = np.searchsorted(packed_ends, np.arange(packed_count) * self.width, side="right")
        packed_place = np.flatnonzero(~full)[first_piece]
        places = np.concatenate([full_place, packed_place])
        ids = np.concatenate([np.arange(len(full_place)), -1 - np.arange(packed_count)])
        order = ids[np.argsort(places, kind="stable")]
        return Epoch(order, self.piece_starts[drawn[full]], self.piece_starts[short], packed_ends)

    def spans(self, i: int) -> list[tuple[int, int]]:
        number, within = divmod(i, self.per_epoch)
        epoch = self.epoch(number)
        which = int(epoch.order[within])
        if which >= 0:
            start = int(epoch.full_starts[which])
            return [(start, start + self.width)]
        begin = (-1 - which) * self.width  # the sequence's span of the packed stream
        first = int(np.searchsorted(epoch.packed_ends, begin, side="right"))
        spans, filled = [], begin
        for piece in range(first, len(epoch.packed_ends)):
            piece_begin = int(epoch.packed_ends[piece - 1]) if piece else 0
            start = int(epoch.packed_starts[piece]) + (filled - piece_begin)
            take = min(int(epoch.packed_ends[piece]), begin + self.width) - filled
            spans.append((start, start + take))
            filled += take
            if filled == begin + self.width:
                break
        return spans


def describe(source: PackedDocuments, path: str | Path) -> str:
    """The dry run's line for document sampling."""
    return (f"{path}: {len(source.tokens):,} tokens in {len(source.piece_starts):,} document pieces "
            f"({source.long_documents:,} documents of at least train.seq_len), {source.per_epoch:,} packed "
            f"sequences per pass")
