"""Training batches as a pure function of the step number.

`source.batch(step)` returns the global batch of 1-based step `step` as numpy
arrays: `inputs` and `targets` [B, S] (targets are inputs shifted by one),
and, when `data.eos_id` is set, `segment_ids` and `positions` [B, S] so that
attention and RoPE restart at every packed document. Because a batch depends
only on the step (and the seed), resuming needs no data-loader state.

`tokens` semantics (data.shuffle=false): sample i is tokens[i*S : i*S + S + 1],
sample indices wrap modulo the number of whole samples, and step t takes
samples (t-1)*B ... t*B-1. With shuffle, each pass over the samples follows
its own seeded permutation. `data.sampling: documents` packs sequences from
whole documents instead (`jlong.data.documents`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jlong.config import Config
from jlong.errors import JlongError


class TokenFile:
    """A 1-D integer .npy of token ids, memory-mapped (a 10 GB file costs no RAM)."""

    def __init__(self, path: str | Path, *, seq_len: int, batch_size: int, vocab_size: int, shuffle: bool = False,
                 seed: int = 0, setting: str = "data.path"):
        """`setting`: the config key that named the file, for the messages."""
        path = Path(path)
        named = f"{setting} {str(path)!r}"
        if not path.is_file():
            raise JlongError(f"{named} does not exist; make one with 'jlong prepare'")
        try:
            tokens = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as err:
            raise JlongError(f"{named} is not a readable .npy file ({err})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise JlongError(f"{named} must hold a 1-D integer array of token ids, got shape {tokens.shape} of "
                             f"{tokens.dtype}")
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise JlongError(
                f"{named} holds {len(tokens)} tokens, fewer than one sample of train.seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter train.seq_len"
            )
        largest = _max_id(tokens)
        if largest >= vocab_size or tokens.min() < 0:
            raise JlongError(f"{named} holds token id {largest}, outside the model's vocabulary of {vocab_size}")
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.shuffle, self.seed = shuffle, seed

    def sample_index(self, i: int) -> int:
        if not self.shuffle:
            return i % self.num_samples
        epoch, within = divmod(i, self.num_samples)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return int(order[within])

    def window(self, sample: int) -> np.ndarray:
        """Sample `sample`'s S + 1 tokens: tokens[sample*S : sample*S + S + 1]."""
        start = sample * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int32)

    def sequences(self, step: int) -> np.ndarray:
        """[B, S + 1] token windows of step `step` (1-based)."""
        first = (step - 1) * self.batch_size
        return np.stack([self.window(self.sample_index(i)) for i in range(first, first + self.batch_size)])


def _max_id(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))


class SyntheticTokens:
    """Seeded, learnable sequences: each follows a fixed random permutation of
    the vocabulary from a random first token, so the loss can fall to zero."""

    def __init__(self, config: Config):
        self.vocab = config.model.vocab_size
        self.seq_len, self.batch_size = config.train.seq_len, config.train.batch_size
        self.seed = config.train.seed
        self.successor = np.random.default_rng(self.seed).permutation(self.vocab).astype(np.int32)

    def sequences(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step])
        current = rng.integers(0, self.vocab, self.batch_size, dtype=np.int32)
        out = np.empty((self.batch_size, self.seq_len + 1), np.int32)
        for j in range(self.seq_len + 1):
            out[:, j] = current
            current = self.successor[current]
        return out


def batch_layout(config: Config) -> dict[str, tuple[tuple[int, int], np.dtype]]:
    """(shape, dtype) of each array of a step's batch: what `Batches.batch`
    gives and what the compiled step is built for."""
    keys = ["inputs", "targets"]
    if config.data.eos_id is not None:
        keys += ["segment_ids", "positions"]
    shape = (config.train.batch_size, config.train.seq_len)
    return {key: (shape, np.dtype(np.int32)) for key in keys}


def make_source(config: Config):
    """What `sequences(step)` reads from: the token file (windows, or packed whole
    documents: `jlong.data.documents`) or the synthetic sequences."""
    if config.data.source == "synthetic":
        return SyntheticTokens(config)
    tokens = TokenFile(config.data.path, seq_len=config.train.seq_len, batch_size=config.train.batch_size,
                       vocab_size=config.model.vocab_size, shuffle=config.data.shuffle, seed=config.train.seed)
    if config.data.sampling == "documents":
        from jlong.data.documents import PackedDocuments

        return PackedDocuments(config, tokens.tokens)
    return tokens


class Batches:
    """The global batch of each step, with document structure when packed."""

    def __init__(self, config: Config):
        self.source = make_source(config)
        self.eos_id = config.data.eos_id
        self.max_documents = config.attention.max_documents
        self.layout = batch_layout(config)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        sequences = self.source.sequences(step)
        arrays = {"inputs": sequences[:, :-1], "targets": sequences[:, 1:]}
        if self.eos_id is not None:
            arrays.update(document_structure(arrays["inputs"], self.eos_id))
            _check_document_count(arrays["segment_ids"], self.max_documents, step)
        return {key: arrays[key] for key in self.layout}


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


def document_structure(inputs_BS: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Segment ids and in-document positions: a document starts after each eos."""
    B, S = inputs_BS.shape
    starts = np.zeros((B, S), bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs_BS[:, :-1] == eos_id
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32) - 1
    index = np.broadcast_to(np.arange(S, dtype=np.int32), (B, S))
    start_of_document = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return {"segment_ids": segment_ids, "positions": (index - start_of_document).astype(np.int32)}
