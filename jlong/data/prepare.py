"""`jlong prepare`: text files -> a 1-D .npy of token ids for data.source=tokens.

Each file is one document, followed by the end-of-document id. Tokenizes
with a Hugging Face `tokenizers` tokenizer.json when given, otherwise byte
by byte (ids 0-255, with 0 (NUL, absent from text) as end-of-document).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jlong.errors import JlongError

BYTE_EOS_ID = 0


def text_files(inputs: list[str], pattern: str) -> list[Path]:
    files = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob(pattern) if p.is_file()))
        elif path.is_file():
            files.append(path)
        else:
            raise JlongError(f"input {item!r} is neither a file nor a directory")
    if not files:
        raise JlongError(f"no files matching {pattern!r} under {', '.join(inputs)}")
    return files


def prepare(
    output: str,
    inputs: list[str],
    *,
    pattern: str = "*",
    tokenizer_path: str | None = None,
    eos_id: int | None = None,
    max_tokens: int | None = None,
) -> dict:
    """Writes the token file; returns a summary (files, tokens, vocab, eos id)."""
    if not output.endswith(".npy"):
        raise JlongError(f"output {output!r} must end in .npy")
    encode, vocab_size, eos = _encoder(tokenizer_path, eos_id)
    chunks, total, used = [], 0, 0
    for file in tqdm(text_files(inputs, pattern), desc="prepare", unit="file"):
        text = file.read_text(encoding="utf-8", errors="replace")
        ids = encode(text)
        chunks.append(np.asarray(ids + [eos], dtype=np.int64))
        total += len(ids) + 1
        used += 1
        if max_tokens and total >= max_tokens:
            break
    tokens = np.concatenate(chunks)[:max_tokens]
    dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, tokens.astype(dtype))
    os.replace(tmp, out)
    return {"files": used, "tokens": int(len(tokens)), "vocab_size": vocab_size, "eos_id": eos}


def _encoder(tokenizer_path: str | None, eos_id: int | None):
    if tokenizer_path is None:
        return (lambda text: list(text.encode("utf-8"))), 256, BYTE_EOS_ID if eos_id is None else eos_id
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise JlongError("--tokenizer needs the 'tokenizers' package: pip install tokenizers") from None
    if not Path(tokenizer_path).is_file():
        raise JlongError(f"tokenizer file {tokenizer_path!r} does not exist")
    tokenizer = Tokenizer.from_file(tokenizer_path)
    if eos_id is None:
        raise JlongError("with --tokenizer, give the end-of-document id with --eos-id")
    return (lambda text: tokenizer.encode(text, add_special_tokens=False).ids), tokenizer.get_vocab_size(), eos_id
