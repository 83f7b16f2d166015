"""Whether a checkpoint step still holds the bytes that were written into it.

When a step is saved, each process lists the files it wrote there with each
one's size and CRC-32: process 0 in `jlong_files.json` (with the number of
processes), process N in `jlong_files.process_N.json`. orbax writes a
process's array data under `ocdbt.process_N/` and its array metadata in
`array_metadatas/process_N`; every other file is process 0's. Before a step
is read, the files are compared with those lists: a file missing, truncated,
or whose bytes changed in place (a bit flipped by the disk or a copy, a
partial rsync over an old file) is named. Nothing here starts jax or orbax.

CRC-32 (zlib) catches every change of up to 32 adjacent bits and any other
with probability 1 - 2^-32, and was the fastest of Python's standard
checksums tried. Measured on the 2-core AMD EPYC development machine (shared, so a
range): streamed in 8 MiB blocks through a 1.5 GiB file just written (in the
page cache), CRC-32 ran at 1.8-2.1 GiB/s on one core, blake2b at 0.7 and
sha256 at 1.4; an orbax save of 1.5 GiB of float32 arrays (1.38 GiB on
disk) took 5.4-10.2 s and its checksums 0.48-0.88 s more (about 9%);
checking them at a restore took 0.55-0.80 s. Files are summed on several
threads (zlib releases the GIL), each process its own files.

Steps without checksums (written by an older jlong, which listed sizes
only or nothing, or whose save stopped before its list was written) are
checked as far as their lists go, and `has_checksums` tells.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePath

from jlong.errors import JlongError
from jlong.files import write_atomically

FILE_LIST = "jlong_files.json"  # process 0's list; process N's is jlong_files.process_N.json
_BLOCK_BYTES = 8 * 2**20
_PROCESS_PART = re.compile(r"(?:ocdbt\.)?process_(\d+)")


def saved_steps(directory: str | Path) -> list[int]:
    """The complete steps in a checkpoint directory, read from its listing (orbax is not started)."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.is_dir() and p.name.isdigit())


def list_name(process: int) -> str:
    return FILE_LIST if process == 0 else f"jlong_files.process_{process}.json"


def writer_of(relative: PurePath, process_count: int) -> int:
    """The process that wrote a file of a step, by orbax's layout."""
    for part in relative.parts:
        found = _PROCESS_PART.fullmatch(part)
        if found and int(found.group(1)) < process_count:
            return int(found.group(1))
    return 0


def record_files(step_dir: Path, process: int, process_count: int) -> None:
    """Lists the size and CRC-32 of each file `process` wrote into `step_dir`."""
    names = [f.relative_to(step_dir) for f in sorted(step_dir.rglob("*")) if f.is_file()]
    mine = [n for n in names if not n.name.startswith("jlong_files") and writer_of(n, process_count) == process]
    sums = checksums([step_dir / n for n in mine])
    files = {str(n): [(step_dir / n).stat().st_size, crc] for n, crc in zip(mine, sums)}
    listed = {"checksum": "crc32", "files": files}
    if process == 0:
        listed["processes"] = process_count
    write_atomically(step_dir / list_name(process), json.dumps(listed, indent=0))


def has_checksums(step_dir: Path) -> bool:
    """Whether the step's files were listed with checksums (not by an older jlong)."""
    try:
        return "checksum" in json.loads((step_dir / FILE_LIST).read_text())
    except (OSError, ValueError):
        return False


def listed_files(step_dir: Path) -> dict[str, list] | None:
    """Every file the step's processes listed, with its size and CRC-32 when
    written (None: the step has no complete lists with checksums)."""
    try:
        first = _read_list(step_dir, 0)
        if "checksum" not in first:
            return None
        files = dict(first["files"])
        for writer in range(1, first["processes"]):
            files.update(_read_list(step_dir, writer)["files"])
    except (OSError, ValueError):
        return None
    return files


def find_damage(step_dir: Path, reader: int = 0, readers: int = 1) -> str | None:
    """The first file of the step that differs from what was written, as
    'NAME and how'; None when every listed file matches, or nothing was
    listed (a step from an older jlong). Of several reading processes, reader
    r checks the lists of writers r, r + readers, ... (any number of either)."""
    try:
        first = _read_list(step_dir, 0)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        return f"its {FILE_LIST} cannot be read: {err}"
    if "checksum" not in first:  # an older jlong's list: process 0 listed the size of every file
        return _size_damage(step_dir, {name: [size, None] for name, size in first.items()}) if reader == 0 else None
    for writer in range(reader, first["processes"], readers):
        try:
            listed = first if writer == 0 else _read_list(step_dir, writer)
        except (OSError, ValueError) as err:
            reason = "is missing" if isinstance(err, FileNotFoundError) else f"cannot be read: {err}"
            return f"{list_name(writer)} (process {writer}'s list of its files) {reason}"
        damage = _size_damage(step_dir, listed["files"]) or _checksum_damage(step_dir, listed["files"])
        if damage:
            return damage
    return None


def verify_directory(directory: str | Path) -> str:
    """Checks every step of a checkpoint directory against its lists; the
    one-line summary, or a JlongError naming each damaged step's first damaged file."""
    directory = Path(directory)
    if not directory.is_dir():
        raise JlongError(f"{str(directory)!r} is not a directory")
    steps = saved_steps(directory)
    aside = ", ".join(sorted(p.name for p in directory.glob("*.unreadable*")))
    aside_note = f" ({aside} set aside by a run: not checked)" if aside else ""
    if not steps:
        raise JlongError(f"{str(directory)!r} holds no checkpoint steps (directories named by their step"
                         f"{f'; only {aside}, set aside by a run' if aside else ''})")
    damaged = [f"step {s}: {d}" for s in steps if (d := find_damage(directory / str(s)))]
    if damaged:
        raise JlongError(f"{str(directory)!r}: damaged, {'; '.join(damaged)}")
    checked = [s for s in steps if has_checksums(directory / str(s))]
    unchecked = [s for s in steps if s not in checked]
    said = [f"{_steps(checked)} intact"] if checked else []
    if unchecked:
        said.append(f"{_steps(unchecked)} {'has' if len(unchecked) == 1 else 'have'} no checksums (not checked byte "
                    "for byte)")
    return f"{str(directory)!r}: {'; '.join(said)}{aside_note}"


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"


def _read_list(step_dir: Path, process: int) -> dict:
    listed = json.loads((step_dir / list_name(process)).read_text())
    if not _is_file_list(listed, process):
        raise ValueError("not a list of files")
    return listed


def _is_file_list(listed, process: int) -> bool:
    """{"checksum", "files": {name: [size, crc]}} (and process 0's "processes"),
    or an older jlong's {name: size} of process 0."""
    if not isinstance(listed, dict):
        return False
    if "checksum" not in listed:
        return all(isinstance(size, int) for size in listed.values())
    files = listed.get("files")
    return (isinstance(files, dict) and all(isinstance(entry, list) and len(entry) == 2 for entry in files.values())
            and (process > 0 or isinstance(listed.get("processes"), int)))


def _size_damage(step_dir: Path, files: dict) -> str | None:
    for name, (size, _) in files.items():
        file = step_dir / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} holds {file.stat().st_size:,} bytes, {size:,} when it was written"
    return None


def _checksum_damage(step_dir: Path, files: dict) -> str | None:
    names = list(files)
    for name, now in zip(names, checksums([step_dir / n for n in names], _crc32_or_error)):
        if isinstance(now, OSError):
            return f"{name} cannot be read ({now.strerror or now})"
        if now != files[name][1]:
            return f"{name} changed after it was written (CRC-32 {now}, {files[name][1]} when written)"
    return None


def _crc32(path: Path) -> str:
    crc = 0
    with path.open("rb") as f:
        while block := f.read(_BLOCK_BYTES):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def _crc32_or_error(path: Path) -> str | OSError:
    try:
        return _crc32(path)
    except OSError as err:
        return err


def checksums(paths: list[Path], checksum=_crc32) -> list:
    """`checksum` of each file (the CRC-32 as 8 hex digits), several files at a time."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(checksum, paths))
