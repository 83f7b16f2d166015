"""`data.mix`: each step's batch drawn from several token corpora in
proportion to their weights.

Source i's share is p_i = weight_i / sum(weights). Of a batch of B
sequences it gets floor(B p_i), and the remainder (B less those) goes one
sequence each to sources chosen by systematic sampling over the fractional
parts B p_i - floor(B p_i), from one uniform draw seeded by (train.seed,
step): every source gets exactly B p_i sequences per step in expectation,
and never more than one away from it. Each source reads its own sequences
in order (its k-th sequence is its sampler's row k: windows or packed
documents, shuffled or not, as its settings say), so a step's batch is a
function of the step and the seed alone and a resumed run reads exactly
the batches it would have read.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_REMAINDER_STREAM = 0x313C  # keeps the remainder's draws apart from the samplers' own seeded streams


@dataclasses.dataclass(frozen=True)
class MixedSource:
    name: str
    sampler: object  # a RowSampler: a TokenFile or PackedDocuments
    weight: float
    eos_id: int | None


class Mixture:
    """The [B, S + 1] rows of each step, drawn from weighted sources."""

    def __init__(self, sources: list[MixedSource], *, seq_len: int, batch_size: int, seed: int):
        self.sources, self.seq_len, self.batch_size, self.seed = sources, seq_len, batch_size, seed
        weights = np.array([s.weight for s in sources], np.float64)
        self.expected = batch_size * weights / weights.sum()  # sequences per step, in expectation
        self.base = np.floor(self.expected).astype(np.int64)
        self._cumulative = [np.zeros(len(sources), np.int64)]  # sequences drawn before step 1, 2, ...

    def counts(self, step: int) -> np.ndarray:
        """Sequences of each source in step `step` (1-based); they sum to the batch size."""
        remainder = self.batch_size - int(self.base.sum())
        counts = self.base.copy()
        if remainder:
            fractions = np.cumsum(self.expected - self.base)
            start = np.random.default_rng([self.seed, step, _REMAINDER_STREAM]).random()
            chosen = np.searchsorted(fractions, start + np.arange(remainder), side="right")
            np.add.at(counts, np.minimum(chosen, len(counts) - 1), 1)
        return counts

    def drawn_before(self, step: int) -> np.ndarray:
        """Sequences each source gave steps 1 .. step - 1 (kept, so a run pays for each step once)."""
        while len(self._cumulative) < step:
            self._cumulative.append(self._cumulative[-1] + self.counts(len(self._cumulative)))
        return self._cumulative[step - 1]

    def sources_of(self, step: int) -> np.ndarray:
        """[B] the source of each row of step `step`'s batch (sources in config order)."""
        return np.repeat(np.arange(len(self.sources)), self.counts(step))

    def sequences(self, step: int) -> np.ndarray:
        """[B, S + 1] token rows of step `step` (1-based)."""
        first, counts = self.drawn_before(step), self.counts(step)
        return np.stack([source.sampler.row(int(first[i]) + k)
                         for i, source in enumerate(self.sources) for k in range(counts[i])])

    def trained(self, step: int) -> np.ndarray | None:
        """[B, S + 1] which ids of step `step`'s rows are trained (a source without a mask: all; None: every
        source's all)."""
        if not any(source.sampler.tokens.masked for source in self.sources):
            return None
        first, counts = self.drawn_before(step), self.counts(step)
        return np.stack([source.sampler.trained_row(int(first[i]) + k)
                         for i, source in enumerate(self.sources) for k in range(counts[i])])

    def eos_ids(self, step: int) -> np.ndarray:
        """[B] each row's end-of-document id (-1, matching no id, for a source without one)."""
        ids = np.array([-1 if s.eos_id is None else s.eos_id for s in self.sources], np.int64)
        return ids[self.sources_of(step)]

    def tokens_by_source(self, step: int) -> dict[str, int]:
        """Target tokens each source gave step `step`."""
        return {s.name: int(n) * self.seq_len for s, n in zip(self.sources, self.counts(step))}
