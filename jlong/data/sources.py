"""Training batches as a pure function of the step number.

`source.batch(step)` returns the global batch of 1-based step `step` as numpy
arrays: `inputs` and `targets` [B, S] (targets are inputs shifted by one),
and, when `data.eos_id` is set, `segment_ids` and `positions` [B, S] so that
attention and RoPE restart at every packed document; and, with
`data.loss_mask`, `loss_mask` [B, S]: the targets whose ids the token
files' masks mark as trained (`jlong prepare --chat`). With
`train.objective: dpo`, rows of whole preference pairs (`data.sampling:
pairs`, `jlong.data.pairs`) and two more arrays: `loss_mask` [B, S] bool,
True exactly at the targets that are completion ids, and `pair_documents`
[B, S] int32, the completion each target belongs to: 2p for the chosen
completion of the row's p-th pair, 2p + 1 for its rejected one, -1 for
every other target (prompts, end ids, padding); the slots of a row stay
below attention.max_documents. Because a batch depends
only on the step (and the seed), resuming needs no data-loader state.

`tokens` semantics (data.shuffle=false): sample i is tokens[i*S : i*S + S + 1],
sample indices wrap modulo the number of whole samples, and step t takes
samples (t-1)*B ... t*B-1. With shuffle, each pass over the samples follows
its own seeded permutation. `data.sampling: documents` packs sequences from
whole documents instead (`jlong.data.documents`). `data.path` may name shards
(`jlong.data.corpus`), read as one corpus; `data.mix` draws each batch from
several corpora by weight (`jlong.data.mixture`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jlong.config import Config
from jlong.data.corpus import RowSampler, TokenCorpus
from jlong.data.documents import PackedDocuments
from jlong.data.mixture import MixedSource, Mixture
from jlong.data.pairs import PreferencePairs
from jlong.errors import JlongError


class TokenFile(RowSampler):
    """Windows of a token corpus (`jlong.data.corpus`: one .npy, or shards),
    memory-mapped (a 10 GB file costs no RAM)."""

    def __init__(self, path: str | Path | Sequence[str], *, seq_len: int, batch_size: int, vocab_size: int,
                 shuffle: bool = False, seed: int = 0, setting: str = "data.path"):
        """`setting`: the config key that named the files, for the messages."""
        tokens = TokenCorpus(path, setting)
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise JlongError(
                f"{tokens.named} holds {len(tokens)} tokens, fewer than one sample of train.seq_len + 1 = "
                f"{seq_len + 1}; use more data or a shorter train.seq_len"
            )
        check_vocabulary(tokens, vocab_size)
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.shuffle, self.seed = shuffle, seed

    def sample_index(self, i: int) -> int:
        if not self.shuffle:
            return i % self.num_samples
        epoch, within = divmod(i, self.num_samples)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return int(order[within])

    def window_span(self, sample: int) -> tuple[int, int]:
        """Where sample `sample`'s S + 1 tokens are: tokens[sample*S : sample*S + S + 1]."""
        start = sample * self.seq_len
        return start, start + self.seq_len + 1

    def spans(self, i: int) -> list[tuple[int, int]]:
        return [self.window_span(self.sample_index(i))]


def check_vocabulary(tokens: TokenCorpus, vocab_size: int) -> None:
    """Every id of the corpus inside the model's vocabulary."""
    smallest, largest = tokens.id_range()
    if largest >= vocab_size or smallest < 0:
        raise JlongError(f"{tokens.named} holds token id {largest if largest >= vocab_size else smallest}, "
                         f"outside the model's vocabulary of {vocab_size}")


class SyntheticTokens:
    """Seeded, learnable sequences: each follows a fixed random permutation of
    the vocabulary from a random first token, so the loss can fall to zero."""

    def __init__(self, *, vocab_size: int, seq_len: int, batch_size: int, seed: int):
        self.vocab, self.seq_len, self.batch_size, self.seed = vocab_size, seq_len, batch_size, seed
        self.successor = np.random.default_rng(self.seed).permutation(self.vocab).astype(np.int32)

    def sequences(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        current = rng.integers(0, self.vocab, self.batch_size, dtype=np.int32)
        out = np.empty((self.batch_size, self.seq_len + 1), np.int32)
        for j in range(self.seq_len + 1):
            out[:, j] = current
            current = self.successor[current]
        return out

    def trained(self, step: int) -> None:
        """Every token is trained."""
        return None


# DPO with full fine-tuning: [B, N] the reference's log-probabilities of each row's completion slots.
REFERENCE_LOGPS = "reference_logps"


def batch_layout(config: Config) -> dict[str, tuple[tuple[int, int], np.dtype]]:
    """(shape, dtype) of each array of a step's batch: what `Batches.batch`
    gives and what the compiled step is built for."""
    keys = ["inputs", "targets"]
    if config.data.eos_id is not None:
        keys += ["segment_ids", "positions"]
    shape = (config.train.batch_size, config.train.seq_len)
    layout = {key: (shape, np.dtype(np.int32)) for key in keys}
    if config.data.loss_mask or config.train.objective == "dpo":
        layout["loss_mask"] = (shape, np.dtype(np.bool_))
    if config.train.objective == "dpo":
        layout["pair_documents"] = (shape, np.dtype(np.int32))
        if config.lora is None:  # full fine-tuning: the reference's log-probabilities travel with the batch
            layout[REFERENCE_LOGPS] = ((config.train.batch_size, config.attention.max_documents), np.dtype(np.float32))
    return layout


def make_source(config: Config):
    """What `sequences(step)` reads from: the token corpus (windows, or packed
    whole documents: `jlong.data.documents`), a weighted mixture of corpora
    (`jlong.data.mixture`) or the synthetic sequences."""
    data = config.data
    if data.source == "synthetic" and data.sampling == "pairs":
        raise JlongError("data.sampling=pairs reads preference pairs from a token file: set data.source=tokens and "
                         "data.path to what 'jlong prepare --preference' wrote")
    if data.source == "synthetic":
        return SyntheticTokens(vocab_size=config.model.vocab_size, seq_len=config.train.seq_len,
                               batch_size=config.train.batch_size, seed=config.train.seed)
    if data.mix is None:
        return _sampler(config, data.path, "data.path", sampling=data.sampling, shuffle=data.shuffle,
                        eos_id=data.eos_id, long_document_weight=data.long_document_weight)
    sources = []
    for i, entry in enumerate(data.mix_sources):
        eos_id = data.eos_id if entry.eos_id is None else entry.eos_id
        sampler = _sampler(config, entry.path, f"data.mix[{i}].path", sampling=entry.sampling or data.sampling,
                           shuffle=data.shuffle if entry.shuffle is None else entry.shuffle, eos_id=eos_id,
                           long_document_weight=entry.long_document_weight or data.long_document_weight)
        sources.append(MixedSource(entry.label, sampler, entry.weight, eos_id))
    return Mixture(sources, seq_len=config.train.seq_len, batch_size=config.train.batch_size, seed=config.train.seed)


def _sampler(config: Config, path, setting: str, *, sampling: str, shuffle: bool, eos_id: int | None,
             long_document_weight: float):
    """The rows of one token corpus: its windows, or whole documents packed."""
    train = config.train
    if sampling == "pairs":
        if eos_id is None:
            raise JlongError(f"data.sampling=pairs splits {setting}'s pairs into documents at the end-of-document "
                             "id, but none is set or recorded: set data.eos_id")
        tokens = TokenCorpus(path, setting)
        check_vocabulary(tokens, config.model.vocab_size)
        return PreferencePairs(tokens, seq_len=train.seq_len, batch_size=train.batch_size, seed=train.seed,
                               eos_id=eos_id, max_documents=config.attention.max_documents)
    tokens = TokenFile(path, seq_len=train.seq_len, batch_size=train.batch_size, vocab_size=config.model.vocab_size,
                       shuffle=shuffle, seed=train.seed, setting=setting)
    if sampling == "documents":
        return PackedDocuments(tokens.tokens, seq_len=train.seq_len, batch_size=train.batch_size, seed=train.seed,
                               eos_id=eos_id, long_document_weight=long_document_weight)
    return tokens


class Batches:
    """The global batch of each step, with document structure when packed."""

    def __init__(self, source, *, layout: dict, eos_id: int | None, max_documents: int):
        """`source`: what `sequences(step)` reads from (`make_source`); `layout`: `batch_layout`'s."""
        self.source, self.layout, self.eos_id, self.max_documents = source, layout, eos_id, max_documents
        self.reference: np.ndarray | None = None  # [pairs, 2] (chosen, rejected): `use_reference`

    def use_reference(self, logps_P2: np.ndarray) -> None:
        """DPO with full fine-tuning: each pair's reference log-probabilities, computed once
        (`jlong.training.reference_logps`), which every batch then carries."""
        self.reference = logps_P2

    @classmethod
    def from_config(cls, config: Config) -> Batches:
        return cls(make_source(config), layout=batch_layout(config), eos_id=config.data.eos_id,
                   max_documents=config.attention.max_documents)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        sequences = self.source.sequences(step)
        arrays = {"inputs": sequences[:, :-1], "targets": sequences[:, 1:]}
        if "loss_mask" in self.layout:  # a target is trained where its id is
            trained = self.source.trained(step)
            arrays["loss_mask"] = np.ones(arrays["targets"].shape, bool) if trained is None else trained[:, 1:]
        if "pair_documents" in self.layout:  # the completion each target belongs to
            arrays["pair_documents"] = self.source.pair_slots(step)[:, 1:]
            _check_pair_count(arrays["pair_documents"], self.max_documents, step)
        if REFERENCE_LOGPS in self.layout:
            arrays[REFERENCE_LOGPS] = self._reference_of(step)
        if self.eos_id is not None:
            mixed = isinstance(self.source, Mixture)
            eos_id = self.source.eos_ids(step)[:, None] if mixed else self.eos_id  # each row's source's own
            arrays.update(document_structure(arrays["inputs"], eos_id))
            _check_document_count(arrays["segment_ids"], self.max_documents, step)
        return {key: arrays[key] for key in self.layout}

    def _reference_of(self, step: int) -> np.ndarray:
        """[B, N]: slot 2p and 2p + 1 of each row, its p-th pair's reference (chosen, rejected); 0 elsewhere."""
        if self.reference is None:
            raise RuntimeError("a full fine-tuning DPO batch needs the reference's log-probabilities: use_reference")
        out = np.zeros(self.layout[REFERENCE_LOGPS][0], np.float32)
        for b, pairs in enumerate(self.source.pairs_of_step(step)):
            out[b, :2 * len(pairs)] = self.reference[pairs].reshape(-1)
        return out

    def drawn(self, step: int) -> dict:
        """What step `step` drew from each source of a mixture, for its metrics line (nothing otherwise)."""
        if isinstance(self.source, Mixture):
            return {"tokens_by_source": self.source.tokens_by_source(step)}
        return {}


def _check_document_count(segment_ids_BS: np.ndarray, max_documents: int, step: int) -> None:
    """cuDNN's packed attention takes at most `max_documents` per sequence; a
    batch over it stops the run rather than mask documents wrongly (checked
    whatever the kernel, so a CPU rehearsal finds it before a GPU run)."""
    most = int(segment_ids_BS[:, -1].max()) + 1
    if most > max_documents:
        raise JlongError(
            f"step {step}'s batch has a sequence of {most} documents, over attention.max_documents "
            f"({max_documents}): raise it (cuDNN's statistics grow with it) or use shorter train.seq_len"
        )


def _check_pair_count(pair_documents_BS: np.ndarray, max_documents: int, step: int) -> None:
    """The objective sums each completion into one of attention.max_documents slots per row."""
    most = int(pair_documents_BS.max(initial=-1)) + 1
    if most > max_documents:
        raise JlongError(f"step {step}'s batch has a row of {most} completion slots ({-(-most // 2)} preference "
                         f"pairs), over attention.max_documents ({max_documents}): raise it or use a shorter "
                         "train.seq_len")


def document_structure(inputs_BS: np.ndarray, eos_id) -> dict[str, np.ndarray]:
    """Segment ids and in-document positions: a document starts after each eos
    (`eos_id`: one id, or [B, 1] ids, one per row)."""
    B, S = inputs_BS.shape
    starts = np.zeros((B, S), bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs_BS[:, :-1] == eos_id
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    index = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    start_of_document = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {"segment_ids": segment_ids, "positions": (index - start_of_document).astype(np.int32)}
