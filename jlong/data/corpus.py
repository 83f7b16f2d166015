"""A corpus of token ids: one token file, a directory of shards, or a list of
either, read as the shards' ids end to end.

A directory holds every token file `jlong prepare` wrote there (`*.npy`
other than the `.documents.npy` indices), in file-name order. Each shard is
memory-mapped where it lies, never copied; a slice that crosses shards
joins the pieces of just that slice. Document indices (`NAME.documents.npy`)
are merged with each shard's offset, so a corpus in shards trains exactly
as the same ids in one file. Shards whose summaries (`NAME.documents.json`)
name other vocabularies or end ids, a prepare-numbered shard missing from
its sequence, and a shard whose index is there without its token file are
refused in one line.

A token file that `jlong prepare --chat` wrote has a mask beside it,
NAME.mask.npy: which ids are trained, one bool or uint8 per id or
`np.packbits` of them (8 ids a byte, the first in the high bit). `trained`
reads it like the ids; a file without one trains every id. A token file of
preference pairs (`jlong prepare --preference`) has NAME.pairs.npy beside
it: [pairs, 2] int64, the first offset of each pair's chosen document and
of its rejected one, which ends where the next pair starts (or at the
file's end); `pair_starts` merges them with each shard's offset.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from jlong.errors import JlongError

INDEX_SUFFIX = ".documents.npy"
MASK_SUFFIX = ".mask.npy"
PAIRS_SUFFIX = ".pairs.npy"
SHARD_NAME = re.compile(r"part-(\d+)\.npy")  # the shards `jlong prepare` numbers


def index_paths(tokens_path: str | Path) -> dict[str, Path]:
    """Where the document index, its summary and its histogram of a token file are."""
    path = Path(tokens_path)
    stem = path.name.removesuffix(".npy")
    return {kind: path.with_name(f"{stem}.documents.{kind}") for kind in ("npy", "json", "png")}


def mask_path(tokens_path: str | Path) -> Path:
    """Where the mask of trained ids of a token file is."""
    path = Path(tokens_path)
    return path.with_name(path.name.removesuffix(".npy") + MASK_SUFFIX)


def pairs_path(tokens_path: str | Path) -> Path:
    """Where the pairs index of a preference token file is (`jlong prepare --preference`)."""
    path = Path(tokens_path)
    return path.with_name(path.name.removesuffix(".npy") + PAIRS_SUFFIX)


def token_files(paths: str | Sequence[str], setting: str) -> list[Path]:
    """The token files `paths` name: files as given, directories' shards in name order."""
    found = []
    for item in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(item)
        if path.is_dir():
            found.extend(_shards_in(path, setting))
        elif path.is_file():
            found.append(path)
        else:
            raise JlongError(f"{setting} {str(path)!r} does not exist; make one with 'jlong prepare'")
    return found


def _shards_in(directory: Path, setting: str) -> list[Path]:
    shards = sorted(p for p in directory.glob("*.npy")
                    if not p.name.endswith((INDEX_SUFFIX, MASK_SUFFIX, PAIRS_SUFFIX)) and p.is_file())
    for index in sorted(directory.glob("*" + INDEX_SUFFIX)):
        shard = index.with_name(index.name.removesuffix(INDEX_SUFFIX) + ".npy")
        if not shard.is_file():
            raise JlongError(f"{setting} {str(directory)!r} is missing the shard {shard.name} (its index "
                             f"{index.name} is there): restore it, or remove its .documents.* files to leave it out")
    numbers = [int(m.group(1)) for p in shards if (m := SHARD_NAME.fullmatch(p.name))]
    for before, after in zip(numbers, numbers[1:]):
        if after != before + 1:
            raise JlongError(f"{setting} {str(directory)!r} is missing the shard part-{before + 1:05d}.npy between "
                             f"part-{before:05d}.npy and part-{after:05d}.npy: restore it, or renumber the shards "
                             "that follow to leave it out")
    if not shards:
        raise JlongError(f"{setting} {str(directory)!r} holds no token files; make some with 'jlong prepare'")
    return shards


class TokenCorpus:
    """The ids of one or more token files end to end: `len`, slices, `dtype`."""

    def __init__(self, paths: str | Sequence[str], setting: str = "data.path"):
        """`setting`: the config key that named the files, for the messages."""
        self.setting = setting
        self.files = token_files(paths, setting)
        self.arrays = [self._open(path) for path in self.files]
        self.offsets = np.concatenate([[0], np.cumsum([len(a) for a in self.arrays])]).astype(np.int64)
        self.dtype = np.result_type(*(a.dtype for a in self.arrays))
        self.masks = [_open_mask(path, len(tokens), self.setting) for path, tokens in zip(self.files, self.arrays)]
        self.masked = any(mask is not None for mask in self.masks)
        self.named = (f"{setting} {str(self.files[0])!r}" if isinstance(paths, (str, Path)) and len(self.files) == 1
                      else f"{setting} {_shown(paths)} ({len(self.files)} token files)")
        self._check_summaries()

    def _open(self, path: Path) -> np.ndarray:
        named = f"{self.setting} {str(path)!r}"
        tokens = _load_npy(path, named, "a token file")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise JlongError(f"{named} must hold a 1-D integer array of token ids, got shape {tokens.shape} of "
                             f"{tokens.dtype}")
        return tokens

    def _check_summaries(self) -> None:
        """Shards prepared with other vocabularies or end ids do not make one corpus."""
        seen = {}
        for path in self.files:
            summary = index_paths(path)["json"]
            if not summary.is_file():
                continue
            try:
                facts = json.loads(summary.read_text())
            except (OSError, ValueError):
                continue  # a damaged summary is only a summary: the ids are checked when read
            for key in ("vocab_size", "eos_id"):
                if key in facts and seen.setdefault(key, (facts[key], path))[0] != facts[key]:
                    first, where = seen[key]
                    raise JlongError(f"{self.setting} mixes token files prepared with different {key}s: "
                                     f"{where.name} has {first}, {path.name} has {facts[key]}; prepare them with "
                                     "one tokenizer and end id")
        self.prepared_with = {key: value for key, (value, _) in seen.items()}

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, span: slice) -> np.ndarray:
        start, stop, step = span.indices(len(self))
        if step != 1:
            raise IndexError("a token corpus is read in contiguous slices")
        if len(self.arrays) == 1:
            return self.arrays[0][start:stop]
        pieces = [self.arrays[file][begin:end] for file, begin, end in self._within_files(start, stop)]
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]

    def _within_files(self, start: int, stop: int):
        """(file, begin, end): the pieces of ids [start, stop) in each file they cross, in that file's offsets."""
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < stop:
            offset = int(self.offsets[first])
            end = min(stop, int(self.offsets[first + 1]))
            yield first, start - offset, end - offset
            start, first = end, first + 1

    def trained(self, span: slice) -> np.ndarray:
        """[len] bool: which ids of the slice are trained (all, where a file has no mask)."""
        start, stop, _ = span.indices(len(self))
        pieces = [_mask_slice(self.masks[file], begin, end) for file, begin, end in self._within_files(start, stop)]
        return np.concatenate(pieces) if pieces else np.zeros(0, bool)

    def id_range(self, chunk: int = 1 << 24) -> tuple[int, int]:
        """(smallest, largest) id, read a chunk at a time."""
        lows, highs = [], []
        for tokens in self.arrays:
            for i in range(0, len(tokens), chunk):
                part = tokens[i : i + chunk]
                lows.append(int(part.min()))
                highs.append(int(part.max()))
        return min(lows, default=0), max(highs, default=0)

    def document_starts(self, eos_id: int) -> np.ndarray:
        """Each document's first offset: from the indices `jlong prepare` wrote, or found from the end ids."""
        return np.concatenate([_starts_of(path, tokens, eos_id) + offset
                               for path, tokens, offset in zip(self.files, self.arrays, self.offsets)])

    def pair_starts(self) -> np.ndarray:
        """[pairs, 2] each preference pair's chosen and rejected documents' first offsets, over every file."""
        return np.concatenate([_pairs_of(path, len(tokens), self.setting) + offset
                               for path, tokens, offset in zip(self.files, self.arrays, self.offsets)])


class RowSampler:
    """Rows of a token corpus drawn by index: a subclass gives `spans(i)`,
    the [start, stop) slices of `tokens` that row i joins, and `batch_size`."""

    tokens: TokenCorpus
    batch_size: int

    def spans(self, i: int) -> list[tuple[int, int]]:
        raise NotImplementedError

    def row(self, i: int) -> np.ndarray:
        """The `i`-th row drawn (0-based, over all steps)."""
        return np.concatenate([np.asarray(self.tokens[a:b], np.int32) for a, b in self.spans(i)])

    def trained_row(self, i: int) -> np.ndarray:
        """Which ids of row `i` are trained."""
        return np.concatenate([self.tokens.trained(slice(a, b)) for a, b in self.spans(i)])

    def sequences(self, step: int) -> np.ndarray:
        """[B, S + 1] token rows of step `step` (1-based)."""
        return np.stack([self.row(i) for i in self._rows_of(step)])

    def trained(self, step: int) -> np.ndarray | None:
        """[B, S + 1] which ids of step `step`'s rows are trained (None: all; the corpus has no mask)."""
        return np.stack([self.trained_row(i) for i in self._rows_of(step)]) if self.tokens.masked else None

    def _rows_of(self, step: int) -> range:
        first = (step - 1) * self.batch_size
        return range(first, first + self.batch_size)


class _PackedMask:
    """A mask stored as `np.packbits` of one bool per id."""

    def __init__(self, packed: np.ndarray):
        self.packed = packed


def _open_mask(tokens_path: Path, count: int, setting: str):
    """The mask beside a token file (None without one): a bool array, or a `_PackedMask`."""
    path = mask_path(tokens_path)
    if not path.is_file():
        return None
    mask = _load_npy(path, f"{setting}: the mask {str(path)!r}", "a mask")
    if mask.ndim == 1 and len(mask) == count and mask.dtype in (np.bool_, np.uint8):
        return mask
    if mask.ndim == 1 and len(mask) == -(-count // 8) and mask.dtype == np.uint8:
        return _PackedMask(mask)
    raise JlongError(f"{setting}: the mask {str(path)!r} holds {mask.shape} of {mask.dtype}, but its token file has "
                     f"{count:,} ids: a mask is one bool or uint8 per id, or np.packbits of them "
                     f"({-(-count // 8):,} bytes); prepare the data again")


def _load_npy(path: Path, named: str, kind: str) -> np.ndarray:
    """The array of a .npy file, mapped; anything else (numpy would offer to unpickle it) is one line."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(np.lib.format.MAGIC_PREFIX))
        if magic != np.lib.format.MAGIC_PREFIX:
            raise JlongError(f"{named} is not {kind} (no .npy header): give a file 'jlong prepare' wrote")
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as err:
        raise JlongError(f"{named} is not {kind}: not a readable .npy file ({err})") from None


def _mask_slice(mask, start: int, stop: int) -> np.ndarray:
    if mask is None:
        return np.ones(stop - start, bool)
    if isinstance(mask, _PackedMask):
        bits = np.unpackbits(np.asarray(mask.packed[start // 8 : -(-stop // 8)]))
        return bits[start % 8 : start % 8 + stop - start].astype(bool)
    return np.asarray(mask[start:stop]).astype(bool)


def _pairs_of(path: Path, count: int, setting: str) -> np.ndarray:
    index = pairs_path(path)
    if not index.is_file():
        raise JlongError(f"{setting} {str(path)!r} has no pairs index ({index.name}): data.sampling=pairs reads "
                         "preference pairs; prepare them with 'jlong prepare --preference'")
    pairs = _load_npy(index, f"{setting}: the pairs index {str(index)!r}", "a pairs index")
    flat = np.asarray(pairs).reshape(-1).astype(np.int64)
    if (pairs.ndim != 2 or pairs.shape[1] != 2 or not np.issubdtype(pairs.dtype, np.integer) or not len(flat)
            or flat[0] != 0 or flat[-1] >= count or (np.diff(flat) <= 0).any()):
        raise JlongError(f"{setting}: {str(index)!r} does not index the pairs of {str(path)!r} ({count:,} ids); "
                         "prepare the data again")
    return flat.reshape(-1, 2)


def _starts_of(path: Path, tokens: np.ndarray, eos_id: int) -> np.ndarray:
    index = index_paths(path)["npy"]
    if index.is_file():
        starts = np.load(index)
        if starts.ndim != 1 or (len(starts) and (starts[0] != 0 or starts[-1] >= len(tokens))):
            raise JlongError(f"{str(index)!r} does not index {str(path)!r}; remove it, or prepare the data again")
        return starts.astype(np.int64)
    chunk = 1 << 24
    ends = [np.flatnonzero(np.asarray(tokens[i : i + chunk]) == eos_id) + i for i in range(0, len(tokens), chunk)]
    after_ends = np.concatenate([[0], *(e + 1 for e in ends)]).astype(np.int64)
    return after_ends[after_ends < len(tokens)]


def _shown(paths) -> str:
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    return repr(str(items[0])) if len(items) == 1 else "[" + ", ".join(repr(str(p)) for p in items) + "]"
