"""`jlong prepare`: a corpus -> token files of ids, each with its document index.

Documents come from text files, JSON Lines, Parquet or a `datasets`
directory (`jlong.data.readers`); each is tokenized and followed by the
end-of-document id (`jlong.data.encoder`: a Hugging Face tokenizer, or
bytes with 0 as the end id). With `chat`, each record's messages are a
conversation, rendered with the tokenizer's chat template and written with
the mask of the ids to train on (`jlong.data.chat`): NAME.mask.npy beside
the ids, `np.packbits` of one bool per id. With `preference`, each record is
a preference pair (prompt, chosen, rejected), tokenized as TRL's DPO trainer
tokenizes it (`jlong.data.preference`), and written as two adjacent
documents, prompt + chosen then prompt + rejected, with the completions'
ids in the mask and NAME.pairs.npy beside the ids: [pairs, 2] int64, the
first offset of each pair's chosen document and of its rejected one (which
ends where the next pair's chosen document starts, or at the file's end);
pairs are never split between shards, and `max_tokens` keeps whole pairs.
Documents are read in batches and each batch is
encoded by the tokenizer's own batch encoding on every core while the next
batch is read, so prepare runs at the tokenizer's speed.

Output is one token file, OUT.npy, or with `shard_tokens` / `shard_per_input`
a directory of shards (`part-00000.npy`, ... numbered after any already
there, so adding to a corpus is preparing one more shard), which
`data.path` reads as one corpus (`jlong.data.corpus`). Documents are never
split between shards. Beside each token file: NAME.documents.npy (each
document's first offset, int64), NAME.documents.json (counts, vocabulary,
end id, length percentiles and a power-of-two histogram) and
NAME.documents.png (that histogram).

Ids stream to a temporary file, so a corpus larger than memory works.
Everything is written under temporary names and renamed when complete, the
token file last; a run that fails removes what it wrote, so an interrupted
or refused run leaves nothing that looks finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jlong.data.chat import ChatEncoder
from jlong.data.corpus import SHARD_NAME, index_paths, mask_path, pairs_path
from jlong.data.encoder import Encoded, Encoder, tokenizer_threads
from jlong.data.preference import FIELD_HINT, FIELDS, PreferenceEncoder
from jlong.data.readers import documents, records, rows, sources
from jlong.errors import JlongError
from jlong.plots import pyplot

BATCH_CHARACTERS = 1 << 22  # text per batch handed to the tokenizer: enough to keep every core busy
BATCH_DOCUMENTS = 4096


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
    shard_tokens: int | None = None,
    shard_per_input: bool = False,
    workers: int | None = None,
    chat: bool = False,
    messages_field: str = "messages",
    train_on: str = "assistant",
    preference: bool = False,
    max_len: int | None = None,
) -> dict:
    """Writes the token file (or shards) and index; returns the summary
    (documents, tokens, vocab, eos id, lengths, sources; where max_tokens
    stopped it, `stopped_at_max_tokens` and `sources_found`, of which
    `sources` were read; with `chat`, trained tokens
    and skipped conversations; with `preference`, pairs, trained tokens and
    pair lengths; `shards`: the files written). `max_len`: with `preference`,
    the most tokens a pair's two documents may hold (more is refused)."""
    if chat and preference:
        raise JlongError("--chat and --preference are two kinds of corpus: give one")
    if max_len is not None and not preference:
        raise JlongError("--max-len bounds preference pairs: it goes with --preference")
    if shard_tokens is not None and shard_tokens < 1:
        raise JlongError(f"shard_tokens must be positive, got {shard_tokens}", "shard_tokens")
    sharded = shard_tokens is not None or shard_per_input
    if sharded and output.endswith(".npy"):
        raise JlongError(f"output {output!r} is a shard directory when sharding: give a directory, not a .npy file")
    if not sharded and not output.endswith(".npy"):
        raise JlongError(f"output {output!r} must end in .npy (or shard the corpus into a directory with "
                         "shard_tokens or shard_per_input)")
    if not sharded and Path(output).exists():
        raise JlongError(f"output {output!r} exists: prepare never writes over a corpus; remove it first, or name "
                         "another file (to add to a corpus, prepare shards into its directory)")
    if max_tokens is not None and max_tokens < 1:
        raise JlongError(f"max_tokens must be positive, got {max_tokens} (leave it out to take the whole corpus)",
                         "max_tokens")
    tokenizer_threads(workers)
    encoder = (ChatEncoder.load(tokenizer_path, train_on, eos_id) if chat
               else PreferenceEncoder.load(tokenizer_path, eos_id, max_len) if preference
               else Encoder.load(tokenizer_path, eos_id))
    if vocab_size is not None and encoder.vocab_size > vocab_size:
        raise JlongError(f"the tokenizer's vocabulary ({encoder.vocab_size:,}) exceeds --vocab-size {vocab_size:,} "
                         "(the model's): its ids would fall outside the embedding")
    found = sources(inputs, pattern)
    out = Path(output)
    directory = out if sharded else out.parent
    if sharded and out.exists() and not out.is_dir():
        raise JlongError(f"output {output!r} exists and is not a directory")
    created = [d for d in (directory, *directory.parents) if not d.exists()]  # removed again on failure
    directory.mkdir(parents=True, exist_ok=True)
    shards = _ShardNames(out) if sharded else iter([out])
    writer, written, finished, skipped, sources_read, stopped = None, [], False, 0, 0, False
    batches = (_batches(found, lambda source: records(source, messages_field), _conversation_characters) if chat
               else _batches(found, lambda source: rows(source, FIELDS, FIELD_HINT), _pair_characters) if preference
               else _batches(found, lambda source: documents(source, text_field), len))
    unit = 2 if preference else 1  # documents that stay together: a pair's two
    try:
        with tqdm(desc="prepare", unit="tok", unit_scale=True, delay=1.0) as progress:  # quiet when quick
            total = 0
            for source, encoded in _encoded(batches, encoder):
                skipped += encoded.skipped
                sources_read = source + 1
                if not len(encoded.lengths):  # every conversation of the batch skipped
                    continue
                if max_tokens and total + len(encoded.ids) >= max_tokens:
                    if preference:  # the whole pairs that fit
                        encoded, stopped = _whole_pairs(encoded, max_tokens - total), True
                        if not len(encoded.lengths):
                            break
                    else:
                        encoded = encoded.head(max_tokens - total)
                if writer is not None and shard_per_input and source != writer.first_source:
                    written.append(writer.finish())
                    writer = None
                for part in _split(encoded, writer.tokens if writer else 0, shard_tokens, unit):
                    if part is None:  # the shard is full: the next piece starts a new one
                        written.append(writer.finish())
                        writer = None
                        continue
                    writer = writer or _TokenFileWriter(next(shards), encoder, source)
                    writer.add(part, source)
                total += len(encoded.ids)
                progress.update(len(encoded.ids))
                if stopped or (max_tokens and total >= max_tokens):
                    stopped = True
                    break
            if writer is not None:
                written.append(writer.finish())
        if not written and preference and stopped:
            raise JlongError(f"not one whole pair fits in --max-tokens {max_tokens:,}")
        if not written:
            left_out = f" (all {skipped:,} conversations have nothing to train: see --train-on)" if skipped else ""
            raise JlongError(f"the corpus under {', '.join(inputs)} holds no documents{left_out}")
        finished = True
        summary = summarize(np.concatenate([w.lengths for w in written]), encoder, sources_read if stopped else len(found),
                            _trained_count(written))
        if stopped:  # `sources` counts those read before the limit
            summary.update(stopped_at_max_tokens=max_tokens, sources_found=len(found))
        if chat:
            summary["skipped_conversations"] = skipped
        return {**summary, "shards": [str(w.path) for w in written]} if sharded else summary
    finally:
        if writer is not None:
            writer.discard()
        if not finished:
            for done in written:
                done.remove()
            for path in created:  # deepest first; only what this call made, and only when empty
                with contextlib.suppress(OSError):
                    path.rmdir()


def _batches(found: list[Path], read, characters_of) -> Iterator[tuple[int, list]]:
    """(source number, documents `read(source)` gives) in reading order, a batch
    at a time; a batch never spans two sources."""
    for number, source in enumerate(found):
        batch, characters = [], 0
        for item in read(source):
            batch.append(item)
            characters += characters_of(item)
            if characters >= BATCH_CHARACTERS or len(batch) >= BATCH_DOCUMENTS:
                yield number, batch
                batch, characters = [], 0
        if batch:
            yield number, batch


def _conversation_characters(record: tuple[object, str]) -> int:
    """About how much text a conversation (messages, where read) holds."""
    turns = record[0] if isinstance(record[0], list) else []
    return sum(len(t["content"]) for t in turns if isinstance(t, dict) and isinstance(t.get("content"), str))


def _pair_characters(record: tuple[tuple, str]) -> int:
    """About how much text a preference pair holds (each completion with the prompt)."""
    prompt, chosen, rejected = (_text_length(value) for value in record[0])
    return 2 * prompt + chosen + rejected


def _text_length(value) -> int:
    if isinstance(value, str):
        return len(value)
    return _conversation_characters((value, "")) if isinstance(value, list) else 0


def _whole_pairs(encoded: Encoded, keep: int) -> Encoded:
    """The pairs (two documents each) whose ids all lie in the first `keep`."""
    ends = np.cumsum(encoded.lengths)[1::2]
    return encoded.documents(0, 2 * int(np.searchsorted(ends, keep, side="right")))


def _trained_count(written: list[_TokenFileWriter]) -> int | None:
    return None if written[0].trained_count is None else sum(w.trained_count for w in written)


def _encoded(batches, encoder: Encoder | ChatEncoder | PreferenceEncoder) -> Iterator[tuple[int, Encoded]]:
    """(source, encoded documents) per batch: one batch is encoded (the tokenizer
    releases the GIL and uses every core) while the next is read."""
    with ThreadPoolExecutor(1) as pool:
        pending = deque()
        for source, texts in batches:
            pending.append((source, pool.submit(encoder.encode_batch, texts)))
            if len(pending) > 1:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def _split(encoded: Encoded, filled: int, shard_tokens: int | None, unit: int = 1):
    """Pieces of whole documents (whole groups of `unit` documents: a pair's two
    stay together), with None between pieces where the shard (holding `filled`
    tokens) reaches `shard_tokens`."""
    if shard_tokens is None:
        yield encoded
        return
    lengths, first = encoded.lengths.reshape(-1, unit).sum(axis=1), 0
    while first < len(lengths):
        if filled >= shard_tokens:
            yield None
            filled = 0
        ends = np.cumsum(lengths[first:])
        take = max(1, int(np.searchsorted(ends - lengths[first:], shard_tokens - filled, side="left")))
        yield encoded.documents(first * unit, take * unit)
        first, filled = first + take, filled + int(ends[take - 1])


class _ShardNames:
    """part-NNNNN.npy in a directory, numbered after the shards already there."""

    def __init__(self, directory: Path):
        numbers = [int(m.group(1)) for p in directory.glob("part-*.npy") if (m := SHARD_NAME.fullmatch(p.name))]
        self.directory, self.next = directory, max(numbers, default=-1) + 1

    def __next__(self) -> Path:
        path = self.directory / f"part-{self.next:05d}.npy"
        self.next += 1
        return path


class _TokenFileWriter:
    """One token file, its index, (for conversations and pairs) its mask and (for pairs) its pairs index, written
    under temporary names until `finish`."""

    def __init__(self, path: Path, encoder: Encoder | ChatEncoder | PreferenceEncoder, first_source: int):
        self.path, self.encoder, self.first_source = path, encoder, first_source
        self.masked, self.paired = encoder.masked, encoder.paired
        self.finals = {"tokens": path, **index_paths(path)}
        if self.masked:
            self.finals["mask"] = mask_path(path)
        if self.paired:
            self.finals["pairs"] = pairs_path(path)
        self.temporaries = {kind: p.with_name(p.name + ".tmp") for kind, p in self.finals.items()}
        self.temporaries["raw"] = path.with_name(path.name + ".tmp.bin")
        self.raw = self.temporaries["raw"].open("wb")
        if self.masked:
            self.temporaries["raw_mask"] = path.with_name(path.name + ".mask.tmp.bin")
            self.raw_mask = self.temporaries["raw_mask"].open("wb")
        self.tokens, self.sources, self.parts = 0, {first_source}, []
        self.trained_count = 0 if self.masked else None

    def add(self, encoded: Encoded, source: int) -> None:
        encoded.ids.tofile(self.raw)
        if self.masked:
            encoded.trained.astype(np.uint8).tofile(self.raw_mask)
            self.trained_count += int(encoded.trained.sum())
        self.tokens += len(encoded.ids)
        self.parts.append(encoded.lengths)
        self.sources.add(source)

    @property
    def lengths(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)

    def finish(self) -> _TokenFileWriter:
        self._close()
        lengths, temporaries = self.lengths, self.temporaries
        _raw_to_npy(temporaries["raw"], temporaries["tokens"], self.encoder.dtype, self.tokens)
        if self.masked:
            _packed_mask(temporaries["raw_mask"], temporaries["mask"], self.tokens)
        with temporaries["npy"].open("wb") as f:
            np.save(f, np.cumsum(lengths) - lengths)
        if self.paired:  # each pair's chosen and rejected documents' first offsets
            with temporaries["pairs"].open("wb") as f:
                np.save(f, (np.cumsum(lengths) - lengths).reshape(-1, 2))
        summary = summarize(lengths, self.encoder, len(self.sources), self.trained_count)
        temporaries["json"].write_text(json.dumps(summary, indent=1) + "\n")
        plot_lengths(summary, temporaries["png"], title=self.path.name)
        # The token file last: its presence means complete.
        for kind in [k for k in ("npy", "json", "png", "mask", "pairs") if k in self.finals] + ["tokens"]:
            os.replace(temporaries[kind], self.finals[kind])
        for kind in ("raw", "raw_mask"):
            if kind in temporaries:
                temporaries[kind].unlink()
        return self

    def _close(self) -> None:
        self.raw.close()
        if self.masked:
            self.raw_mask.close()

    def discard(self) -> None:
        self._close()
        for path in self.temporaries.values():
            path.unlink(missing_ok=True)

    def remove(self) -> None:
        """Removes a finished file again (a later part of the same run failed)."""
        for path in self.finals.values():
            path.unlink(missing_ok=True)


def _packed_mask(raw: Path, npy: Path, count: int, block: int = 1 << 24) -> None:
    """One byte per id (0/1) -> a .npy of `np.packbits` (8 ids a byte, the first in the high bit), in blocks."""
    with npy.open("wb") as out, raw.open("rb") as bits:
        np.lib.format.write_array_header_1_0(out, {"descr": "|u1", "fortran_order": False, "shape": (-(-count // 8),)})
        while chunk := bits.read(8 * block):
            np.packbits(np.frombuffer(chunk, np.uint8)).tofile(out)


def _raw_to_npy(raw: Path, npy: Path, dtype: np.dtype, count: int) -> None:
    """A .npy header for `count` ids of `dtype`, then the raw ids, copied in blocks."""
    with npy.open("wb") as out, raw.open("rb") as ids:
        np.lib.format.write_array_header_1_0(out, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                   "fortran_order": False, "shape": (count,)})
        shutil.copyfileobj(ids, out, length=1 << 24)


def summarize(lengths: np.ndarray, encoder: Encoder | ChatEncoder | PreferenceEncoder, sources: int,
              trained: int | None = None) -> dict:
    """What a token file holds; for conversations, the trained tokens and how the mask was made."""
    summary = {"documents": len(lengths), "tokens": int(lengths.sum()), "vocab_size": encoder.vocab_size,
               "eos_id": encoder.eos_id, "sources": sources}
    if isinstance(encoder, ChatEncoder):
        summary.update(trained_tokens=trained, chat={"template": Path(encoder.template.where).name,
                                                     "train_on": encoder.train_on})
    if isinstance(encoder, PreferenceEncoder):
        pair_lengths = lengths.reshape(-1, 2).sum(axis=1)
        summary.update(pairs=len(pair_lengths), trained_tokens=trained, preference=encoder.summary(),
                       pair_length=length_summary(pair_lengths)["length"])
    return {**summary, **length_summary(lengths)}


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
