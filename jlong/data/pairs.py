"""`data.sampling: pairs`: rows of whole preference pairs, for
`train.objective: dpo`.

A token file of pairs (`jlong prepare --preference`) holds each pair as two
adjacent documents, prompt + chosen then prompt + rejected, each closed by
the end-of-document id, with the completions' ids in its mask and the
pairs in NAME.pairs.npy (`jlong.data.corpus`). A row holds S + 1 tokens (S =
train.seq_len): a pass over the pairs ("epoch") takes them in a seeded
order and fills each row with the next pairs while they fit whole, then
pads the rest of the row and starts the next row with the pair that did
not fit. A pair longer than S + 1 tokens never fits: it is skipped and
counted (`describe`). Padding is one run of a single id that is not the
end id (`pad_id`), so it adds at most one document to the row, and a row
takes at most (attention.max_documents - 1) // 2 pairs, so its documents,
padding included, stay within attention.max_documents. Padding is never
trained.

Row i is a function of i and the seed alone (a pass's rows follow from its
seeded order), so a resumed run reads exactly the rows it would have read.

For the objective, `pair_slots` gives each id of a row the completion it
belongs to: 2p for an id of the chosen completion of the row's p-th pair,
2p + 1 for one of its rejected completion, -1 for every other id (prompts,
end ids that are not the completion's, padding).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from jlong.data.corpus import RowSampler, TokenCorpus
from jlong.errors import JlongError

_ORDER_STREAM = 0x9A125  # keeps the pairs' order apart from other seeded streams


class PreferencePairs(RowSampler):
    """The [B, S + 1] rows of each step, filled with whole preference pairs."""

    def __init__(self, tokens: TokenCorpus, *, seq_len: int, batch_size: int, seed: int, eos_id: int,
                 max_documents: int):
        if not tokens.masked:
            raise JlongError(f"{tokens.named} has no mask of completion ids: data.sampling=pairs reads preference "
                             "pairs; prepare them with 'jlong prepare --preference'")
        self.tokens, self.width, self.batch_size, self.seed = tokens, seq_len + 1, batch_size, seed
        starts = tokens.pair_starts()
        self.starts, self.rejected = starts[:, 0], starts[:, 1]
        self.lengths = np.append(self.starts[1:], len(tokens)) - self.starts
        self.kept = np.flatnonzero(self.lengths <= self.width)
        self.skipped = len(self.starts) - len(self.kept)
        self.most_pairs = (max_documents - 1) // 2  # two documents a pair, and the padding's one
        if self.most_pairs < 1:
            raise JlongError(f"attention.max_documents ({max_documents}) leaves no room in a row for a preference "
                             "pair (two documents) and its padding: raise it to at least 3")
        if not len(self.kept):
            raise JlongError(f"every one of the {len(self.starts):,} pairs of {tokens.named} is longer than a row "
                             f"(train.seq_len + 1 = {self.width:,} tokens; the shortest is "
                             f"{int(self.lengths.min()):,}): train at a longer train.seq_len")
        self.pad_id = 1 if eos_id == 0 else 0
        self._rows_before = [0]  # rows of the passes before pass 0, 1, ...

    @functools.lru_cache(maxsize=2)
    def epoch(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """Pass `number`: its pairs in order, and where each of its rows starts in that order (then the end)."""
        order = self.kept[np.random.default_rng([self.seed, number, _ORDER_STREAM]).permutation(len(self.kept))]
        return order, self._row_starts(order)

    def _row_starts(self, order: np.ndarray) -> np.ndarray:
        """Where each row starts in `order` (then its end): the next pairs while they fit whole, at most
        most_pairs of them."""
        ends = np.concatenate([[0], np.cumsum(self.lengths[order])])
        firsts, first = [0], 0
        while first < len(order):
            last = int(np.searchsorted(ends, ends[first] + self.width, side="right")) - 1
            first = min(last, first + self.most_pairs)
            firsts.append(first)
        return np.asarray(firsts, np.int64)

    def rows_of_pairs(self, pairs: np.ndarray) -> list[np.ndarray]:
        """Some of the pairs that fit a row, packed into rows as a pass packs them, in the first pass's
        order: each row's pairs (all the kept pairs: the first pass's rows)."""
        first_pass = self.epoch(0)[0]
        order = first_pass[np.isin(first_pass, pairs)]
        firsts = self._row_starts(order)
        return [order[a:b] for a, b in zip(firsts[:-1], firsts[1:])]

    def rows_per_epoch(self, number: int) -> int:
        return len(self.epoch(number)[1]) - 1

    def _locate(self, i: int) -> tuple[int, int]:
        """(pass, row within it) of row `i`."""
        while self._rows_before[-1] <= i:
            self._rows_before.append(self._rows_before[-1] + self.rows_per_epoch(len(self._rows_before) - 1))
        number = int(np.searchsorted(self._rows_before, i, side="right")) - 1
        return number, i - self._rows_before[number]

    def pairs_of(self, i: int) -> np.ndarray:
        """The pairs (indices into the file's pairs) row `i` holds, in order."""
        number, row = self._locate(i)
        order, firsts = self.epoch(number)
        return order[firsts[row] : firsts[row + 1]]

    def spans(self, i: int) -> list[tuple[int, int]]:
        """The row's pairs' spans of the tokens (padding follows them)."""
        return self._spans(self.pairs_of(i))

    def _spans(self, pairs: np.ndarray) -> list[tuple[int, int]]:
        return [(int(self.starts[p]), int(self.starts[p] + self.lengths[p])) for p in pairs]

    def _padding(self, pairs: np.ndarray) -> int:
        return self.width - int(self.lengths[pairs].sum())

    def row(self, i: int) -> np.ndarray:
        return self.row_of(self.pairs_of(i))

    def row_of(self, pairs: np.ndarray) -> np.ndarray:
        """[S + 1] the ids of a row of `pairs` (in that order), then padding."""
        ids = [np.asarray(self.tokens[a:b], np.int32) for a, b in self._spans(pairs)]
        return np.concatenate([*ids, np.full(self._padding(pairs), self.pad_id, np.int32)])

    def trained_row(self, i: int) -> np.ndarray:
        pairs = self.pairs_of(i)
        trained = [self.tokens.trained(slice(a, b)) for a, b in self._spans(pairs)]
        return np.concatenate([*trained, np.zeros(self._padding(pairs), bool)])

    def slot_row(self, i: int) -> np.ndarray:
        return self.slot_row_of(self.pairs_of(i))

    def slot_row_of(self, pairs: np.ndarray) -> np.ndarray:
        """[S + 1] each id's completion slot in a row of `pairs`: 2p (chosen) or 2p + 1 (rejected) of its p-th
        pair, else -1."""
        slots = np.full(self.width, -1, np.int32)
        filled = 0
        for p, pair in enumerate(pairs):
            start, rejected, length = (int(a[pair]) for a in (self.starts, self.rejected, self.lengths))
            trained = self.tokens.trained(slice(start, start + length))
            which = np.where(np.arange(start, start + length) < rejected, 2 * p, 2 * p + 1)
            slots[filled : filled + length] = np.where(trained, which, -1)
            filled += length
        return slots

    def pairs_of_step(self, step: int) -> list[np.ndarray]:
        """The pairs each row of step `step` (1-based) holds, in slot order."""
        return [self.pairs_of(i) for i in self._rows_of(step)]

    def pair_slots(self, step: int) -> np.ndarray:
        """[B, S + 1] `slot_row` of each row of step `step` (1-based)."""
        return np.stack([self.slot_row(i) for i in self._rows_of(step)])

    def trained(self, step: int) -> np.ndarray:
        return np.stack([self.trained_row(i) for i in self._rows_of(step)])


def describe(source: PreferencePairs, path: str | Path) -> str:
    """The run's line for pair sampling."""
    skipped = (f"; {source.skipped:,} longer than a row of train.seq_len + 1 = {source.width:,} tokens are skipped"
               if source.skipped else "")
    rows = source.rows_per_epoch(0)
    return (f"{path}: {len(source.tokens):,} tokens in {len(source.starts):,} preference pairs{skipped}; "
            f"{len(source.kept):,} pairs fill {rows:,} rows in the first pass ({len(source.kept) / rows:.1f} a row, "
            f"at most {source.most_pairs} by attention.max_documents)")
