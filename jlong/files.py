"""Writing files so that a crash never leaves half of one, and setting
earlier outputs aside instead of overwriting them."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path`, written under a temporary name and renamed when complete."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def free_name(path: Path) -> Path:
    """`path` itself if nothing is there, else the first of `path-2`, `path-3`, ... that is free."""
    candidate, copy = path, 1
    while candidate.exists():
        copy += 1
        candidate = path.with_name(f"{path.name}-{copy}")
    return candidate


def with_normal_permissions(path: Path) -> None:
    """Read and write as the process's umask allows (libraries that write
    through a private temporary file leave it readable by its owner only)."""
    mask = os.umask(0)
    os.umask(mask)
    path.chmod(0o666 & ~mask)


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a directory."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
