"""Text -> token ids for `jlong prepare` and the passkey prompts: a Hugging
Face tokenizer (a tokenizer.json, or a directory holding one), or bytes.

`encode_batch` is what prepare calls: the tokenizers library's own batch
encoding, which runs on every core its thread pool has (`workers`) and
gives the same ids as encoding one text at a time.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np

from jlong.errors import JlongError

BYTE_EOS_ID = 0  # NUL: absent from text


class Encoder:
    """Text -> token ids, the end-of-document id, the vocabulary size and the ids' storage type."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        """`tokenizer`: a `tokenizers.Tokenizer`, or None for bytes."""
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self.dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)

    @classmethod
    def load(cls, tokenizer_path: str | None, eos_id: int | None, *, workers: int | None = None) -> Encoder:
        """`workers`: threads of the tokenizer's batch encoding (None: every core)."""
        if workers is not None:
            if workers < 1:
                raise JlongError(f"workers must be at least 1, got {workers}", "workers")
            # The tokenizers library builds its thread pool (rayon's) on first use, from this variable.
            os.environ["RAYON_NUM_THREADS"] = str(workers)
        if tokenizer_path is None:
            return cls(None, 256, BYTE_EOS_ID if eos_id is None else eos_id)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise JlongError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
        path = Path(tokenizer_path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise JlongError(f"tokenizer {tokenizer_path!r} is neither a tokenizer.json nor a directory holding one")
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as err:  # the tokenizers library raises its own exception type for a bad file
            raise JlongError(f"cannot load the tokenizer {str(file)!r} ({err})") from None
        if eos_id is None:
            eos_id = _configured_eos_id(path, tokenizer)
        if not 0 <= eos_id < tokenizer.get_vocab_size():
            raise JlongError(f"--eos-id {eos_id} is outside the tokenizer's vocabulary ({tokenizer.get_vocab_size()})")
        return cls(tokenizer, tokenizer.get_vocab_size(), eos_id)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids of every text, each followed by the end id, as one array of
        `dtype`; each text's length in ids, its end id included)."""
        if self.tokenizer is None:
            encoded = [text.encode("utf-8") for text in texts]
            flat = np.frombuffer(b"".join(encoded), np.uint8)
            lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
            ends = np.cumsum(lengths)
            return np.insert(flat.astype(self.dtype), ends, self.eos_id), lengths + 1
        ids = [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        for each in ids:
            each.append(self.eos_id)
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), self.dtype, int(lengths.sum()))
        return flat, lengths


def _configured_eos_id(path: Path, tokenizer) -> int:
    """The end-of-sequence id a tokenizer directory's tokenizer_config.json names."""
    config = path / "tokenizer_config.json"
    if path.is_dir() and config.is_file():
        token = json.loads(config.read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise JlongError("give the end-of-document id with --eos-id (the tokenizer does not name an eos_token)")
