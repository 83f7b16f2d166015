"""`jlong prepare`: a corpus -> a 1-D .npy of token ids, with its document index.

Documents come from text files, JSON Lines, Parquet or a `datasets`
directory (`jlong.data.readers`); each is tokenized and followed by the
end-of-document id. Tokenizes with a Hugging Face tokenizer (a tokenizer.json,
or a directory holding one) when given, otherwise byte by byte (ids 0-255,
with 0 (NUL, absent from text) as end-of-document).

One streaming pass writes the ids to a temporary file, so a corpus larger
than memory works. Beside OUT.npy it writes OUT.documents.npy (each
document's first offset, int64), OUT.documents.json (counts, length
percentiles and a power-of-two histogram) and OUT.documents.png (that
histogram, log axis). Everything is written under temporary names and
renamed when complete, the token file last: an interrupted or refused run
leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from array import array
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jlong.data.readers import documents, sources
from jlong.errors import JlongError
from jlong.plots import pyplot

BYTE_EOS_ID = 0


def index_paths(tokens_path: str | Path) -> dict[str, Path]:
    """Where the document index, its summary and its histogram of a token file are."""
    path = Path(tokens_path)
    stem = path.name.removesuffix(".npy")
    return {kind: path.with_name(f"{stem}.documents.{kind}") for kind in ("npy", "json", "png")}


def prepare(
    output: str,
    inputs: list[str],
    *,
    pattern: str = "*",
    text_field: str = "text",
    tokenizer_path: str | None = None,
    eos_id: int | None = None,
    max_tokens: int | None = None,
    vocab_size: int | None = None,
) -> dict:
    """Writes the token file and its index; returns the summary (documents, tokens, vocab, eos id, lengths)."""
    if not output.endswith(".npy"):
        raise JlongError(f"output {output!r} must end in .npy")
    if max_tokens is not None and max_tokens < 1:
        raise JlongError(f"max_tokens must be positive, got {max_tokens} (leave it out to take the whole corpus)",
                         "max_tokens")
    encoder = Encoder.load(tokenizer_path, eos_id)
    if vocab_size is not None and encoder.vocab_size > vocab_size:
        raise JlongError(f"the tokenizer's vocabulary ({encoder.vocab_size:,}) exceeds --vocab-size {vocab_size:,} "
                         "(the model's): its ids would fall outside the embedding")
    found = sources(inputs, pattern)
    out = Path(output)
    created = [d for d in (out.parent, *out.parent.parents) if not d.exists()]  # removed again on failure
    out.parent.mkdir(parents=True, exist_ok=True)
    finals = {"tokens": out, **index_paths(out)}
    temporaries = {kind: path.with_name(path.name + ".tmp") for kind, path in finals.items()}
    temporaries["raw"] = out.with_name(out.name + ".tmp.bin")
    finished = False
    try:
        starts, total = _write_ids(temporaries["raw"], found, text_field, encoder, max_tokens)
        if not total:
            raise JlongError(f"the corpus under {', '.join(inputs)} holds no documents")
        _raw_to_npy(temporaries["raw"], temporaries["tokens"], encoder.dtype, total)
        lengths = np.diff(np.append(np.asarray(starts, np.int64), total))
        summary = {"documents": len(lengths), "tokens": total, "vocab_size": encoder.vocab_size,
                   "eos_id": encoder.eos_id, "sources": len(found), **length_summary(lengths)}
        with temporaries["npy"].open("wb") as f:
            np.save(f, np.asarray(starts, np.int64))
        temporaries["json"].write_text(json.dumps(summary, indent=1) + "\n")
        plot_lengths(summary, temporaries["png"], title=out.name)
        for kind in ("npy", "json", "png", "tokens"):  # the token file last: its presence means complete
            os.replace(temporaries[kind], finals[kind])
        finished = True
        return summary
    finally:
        for path in temporaries.values():
            path.unlink(missing_ok=True)
        if not finished:
            for directory in created:  # deepest first; only what this call made, and only when empty
                with contextlib.suppress(OSError):
                    directory.rmdir()


def _write_ids(raw: Path, found: list[Path], text_field: str, encoder: Encoder, max_tokens: int | None):
    """Streams every document's ids (and its end id) into `raw`; (document starts, total tokens)."""
    starts, total = array("q"), 0
    with raw.open("wb") as f, tqdm(desc="prepare", unit="doc", delay=1.0) as progress:  # quiet when quick
        for source in found:
            for text in documents(source, text_field):
                ids = encoder.encode(text) + [encoder.eos_id]
                if max_tokens:
                    ids = ids[: max_tokens - total]
                starts.append(total)
                np.asarray(ids, encoder.dtype).tofile(f)
                total += len(ids)
                progress.update(1)
                progress.set_postfix(tokens=f"{total:,}", refresh=False)
                if max_tokens and total >= max_tokens:
                    return starts, total
    return starts, total


def _raw_to_npy(raw: Path, npy: Path, dtype: np.dtype, count: int) -> None:
    """A .npy header for `count` ids of `dtype`, then the raw ids, copied in blocks."""
    with npy.open("wb") as out, raw.open("rb") as ids:
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                   "fortran_order": False, "shape": (count,)})
        shutil.copyfileobj(ids, out, length=1 << 24)


def length_summary(lengths: np.ndarray) -> dict:
    """Document lengths in tokens (end id included): percentiles and a histogram over powers of two."""
    top = int(lengths.max())
    edges = [1 << k for k in range(0, max(top, 1).bit_length() + 1)]  # [1, 2), [2, 4), ... up past the longest
    counts, _ = np.histogram(lengths, bins=edges)
    percentiles = np.percentile(lengths, [50, 90, 99])
    return {
        "length": {"min": int(lengths.min()), "median": float(percentiles[0]), "mean": float(lengths.mean()),
                   "p90": float(percentiles[1]), "p99": float(percentiles[2]), "max": top},
        "histogram": {"edges": edges, "counts": [int(c) for c in counts]},
    }


def plot_lengths(summary: dict, png: Path, *, title: str) -> None:
    edges, counts = summary["histogram"]["edges"], summary["histogram"]["counts"]
    figure, axes = pyplot().subplots(figsize=(7, 4))
    axes.bar(edges[:-1], counts, width=np.diff(edges), align="edge", edgecolor="black", linewidth=0.5)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("document length (tokens, log scale)")
    axes.set_ylabel("documents")
    axes.set_title(f"{title}: {summary['documents']:,} documents, {summary['tokens']:,} tokens")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png, dpi=100, format="png")  # under prepare's own temporary name
    pyplot().close(figure)


class Encoder:
    """Text -> token ids, the end-of-document id, the vocabulary size and the ids' storage type."""

    def __init__(self, encode, vocab_size: int, eos_id: int):
        self.encode, self.vocab_size, self.eos_id = encode, vocab_size, eos_id
        self.dtype = np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)

    @classmethod
    def load(cls, tokenizer_path: str | None, eos_id: int | None) -> Encoder:
        if tokenizer_path is None:
            return cls(lambda text: list(text.encode("utf-8")), 256, BYTE_EOS_ID if eos_id is None else eos_id)
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
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.get_vocab_size(),
                   eos_id)


def _configured_eos_id(path: Path, tokenizer) -> int:
    """The end-of-sequence id a tokenizer directory's tokenizer_config.json names."""
    config = path / "tokenizer_config.json"
    if path.is_dir() and config.is_file():
        token = json.loads(config.read_text()).get("eos_token")
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and tokenizer.token_to_id(token) is not None:
            return tokenizer.token_to_id(token)
    raise JlongError("give the end-of-document id with --eos-id (the tokenizer does not name an eos_token)")
