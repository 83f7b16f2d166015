"""Text -> token ids for `jlong prepare` and the passkey prompts: a Hugging
Face tokenizer (a tokenizer.json, or a directory holding one), or bytes.

`encode_batch` is what prepare calls: the tokenizers library's own batch
encoding, which runs on every core its thread pool has (`workers`) and
gives the same ids as encoding one text at a time. Conversations are
encoded by `jlong.data.chat` into the same `Encoded` batches, with the mask
of trained ids.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from pathlib import Path

import numpy as np

from jlong.errors import JlongError

BYTE_EOS_ID = 0  # NUL: absent from text


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Documents as prepare writes them: their ids end to end (each followed by
    the end id), each one's length in ids, and for conversations which ids are trained."""

    ids: np.ndarray
    lengths: np.ndarray
    trained: np.ndarray | None = None  # [len(ids)] bool
    skipped: int = 0  # conversations left out: nothing in them to train

    def documents(self, first: int, count: int) -> Encoded:
        """Documents first .. first + count - 1."""
        begin = int(self.lengths[:first].sum())
        end = begin + int(self.lengths[first : first + count].sum())
        trained = None if self.trained is None else self.trained[begin:end]
        return Encoded(self.ids[begin:end], self.lengths[first : first + count], trained)

    def head(self, keep: int) -> Encoded:
        """The first `keep` ids and the documents they start (the last one cut short)."""
        starts = np.cumsum(self.lengths) - self.lengths
        kept = int(np.searchsorted(starts, keep, side="left"))
        lengths = self.lengths[:kept].copy()
        lengths[-1] = min(lengths[-1], keep - starts[kept - 1])
        return Encoded(self.ids[:keep], lengths, None if self.trained is None else self.trained[:keep], self.skipped)


class Encoder:
    """Text -> token ids, the end-of-document id, the vocabulary size and the ids' storage type."""

    masked, paired = False, False  # a mask of trained ids; documents two to a preference pair

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        """`tokenizer`: a `tokenizers.Tokenizer`, or None for bytes."""
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)

    @classmethod
    def load(cls, tokenizer_path: str | None, eos_id: int | None, *, workers: int | None = None) -> Encoder:
        """`workers`: threads of the tokenizer's batch encoding (None: every core)."""
        tokenizer_threads(workers)
        if tokenizer_path is None:
            return cls(None, 256, BYTE_EOS_ID if eos_id is None else eos_id)
        tokenizer = load_tokenizer(tokenizer_path)
        if eos_id is None:
            eos_id = _configured_eos_id(Path(tokenizer_path), tokenizer)
        check_eos_id(eos_id, tokenizer)
        return cls(tokenizer, tokenizer.get_vocab_size(), eos_id)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> Encoded:
        """The texts' ids end to end, each followed by the end id, as `dtype`."""
        if self.tokenizer is None:
            encoded = [text.encode("utf-8") for text in texts]
            flat = np.frombuffer(b"".join(encoded), np.uint8)
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            ends = np.cumsum(lengths)
            return Encoded(np.insert(flat.astype(self.dtype), ends, self.eos_id), lengths + 1)
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        for each in ids:
            each.append(self.eos_id)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        return Encoded(flat, lengths)


def tokenizer_threads(workers: int | None) -> None:
    """Sets the threads of the tokenizer's batch encoding (None: every core), before its first use."""
    if workers is not None:
        if workers < 1:
            raise JlongError(f"workers must be at least 1, got {workers}", "workers")
        # The tokenizers library builds its thread pool (rayon's) on first use, from this variable.
        os.environ["RAYON_NUM_THREADS"] = str(workers)


def load_tokenizer(tokenizer_path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json or a directory holding one."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise JlongError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    path = Path(tokenizer_path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise JlongError(f"tokenizer {tokenizer_path!r} is neither a tokenizer.json nor a directory holding one")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # the tokenizers library raises its own exception type for a bad file
        raise JlongError(f"cannot load the tokenizer {str(file)!r} ({err})") from None


def check_eos_id(eos_id: int, tokenizer) -> None:
    if not 0 <= eos_id < tokenizer.get_vocab_size():
        raise JlongError(f"--eos-id {eos_id} is outside the tokenizer's vocabulary ({tokenizer.get_vocab_size()})")


def _configured_eos_id(path: Path, tokenizer) -> int:
    """The end-of-sequence id a tokenizer directory's tokenizer_config.json names."""
    config = path / "tokenizer_config.json"
    if path.is_dir() and config.is_file():
        token = json.loads(config.read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise JlongError("give the end-of-document id with --eos-id (the tokenizer does not name an eos_token)")
