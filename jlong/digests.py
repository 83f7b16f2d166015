"""Digests of what a result was made from, by content: a file prepared
again or replaced at the same path has another digest, a copy elsewhere
the same one.

- arrays (a preference file's tokens, mask and pairs): SHA-256 of each
  one's dtype, shape and bytes;
- a Hugging Face directory's weights: its config.json, safetensors index
  and *.safetensors files, each by name, size and CRC-32, summed here on
  several threads (CRC-32 ran at about 2 GiB/s a core on the development
  machine, `jlong.checkpoint_integrity`);
- a jlong checkpoint step's weights: the sizes and CRC-32s its processes
  listed for its params when they wrote them, read rather than summed
  again (a step written before jlong listed them is summed here).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from jlong.checkpoint_integrity import checksums, listed_files

_ELEMENTS_PER_BLOCK = 1 << 24
_HF_WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


def array_digest(arrays) -> str:
    """SHA-256 of the arrays' dtypes, shapes and bytes, in order (memory-mapped ones read a block at a time)."""
    digest = hashlib.sha256()
    for array in arrays:
        array = np.asarray(array)
        digest.update(f"{array.dtype.str} {array.shape};".encode())
        flat = array.reshape(-1)
        for first in range(0, len(flat), _ELEMENTS_PER_BLOCK):
            digest.update(np.ascontiguousarray(flat[first : first + _ELEMENTS_PER_BLOCK]))
    return digest.hexdigest()


def hf_digest(directory: str | Path) -> str:
    """The digest of a Hugging Face directory's weights (its config and safetensors files)."""
    directory = Path(directory)
    names = sorted(p.name for p in directory.iterdir()
                   if p.is_file() and (p.name in _HF_WEIGHT_FILES or p.name.endswith(".safetensors")))
    return _files_digest(directory, names)


def checkpoint_digest(step_dir: str | Path) -> str:
    """The digest of a jlong checkpoint step's params, from the file lists written with it."""
    step_dir = Path(step_dir)
    listed = listed_files(step_dir)
    if listed is None:
        names = [str(p.relative_to(step_dir)) for p in sorted((step_dir / "params").rglob("*")) if p.is_file()]
        return _files_digest(step_dir, names)
    return _entries_digest(sorted([name, *entry] for name, entry in listed.items() if name.startswith("params/")))


def _files_digest(root: Path, names: list[str]) -> str:
    sums = checksums([root / name for name in names])
    return _entries_digest([[name, (root / name).stat().st_size, crc] for name, crc in zip(names, sums)])


def _entries_digest(entries: list[list]) -> str:
    """SHA-256 of [name, size, CRC-32] entries."""
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()
