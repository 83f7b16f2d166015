"""The documents of a corpus, one text at a time, from what `jlong prepare` is given.

- a text file: one document (read whole);
- `.jsonl` / `.json` (JSON Lines): one document per line, its `text_field`;
- `.parquet`: one document per row of the `text_field` column, read a batch
  of rows at a time;
- a directory written by `datasets`' `save_to_disk` (it holds
  `dataset_info.json` or `state.json`): one document per row;
- any other directory: the files under it matching the pattern, each read
  by its kind as above.

Nothing is read whole but a text file, so corpora larger than memory stream.
`records` gives any field's values (conversations: lists of turns) with
where each was read, for the messages; `rows` several fields' at once (a
preference pair's prompt, chosen and rejected).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from jlong.errors import JlongError

JSON_LINES = (".jsonl", ".json")
PARQUET = (".parquet",)
PARQUET_BATCH_ROWS = 1024
FIELD_HINT = "name the text with --text-field (conversations: --messages-field)"


def sources(inputs: list[str], pattern: str) -> list[Path]:
    """The files and datasets directories the inputs name, in a fixed order."""
    found = []
    for item in inputs:
        path = Path(item)
        if path.is_dir() and _is_saved_dataset(path):
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(p for p in path.rglob(pattern) if p.is_file()))
        elif path.is_file():
            found.append(path)
        else:
            raise JlongError(f"input {item!r} is neither a file nor a directory")
    if not found:
        raise JlongError(f"no files matching {pattern!r} under {', '.join(inputs)}")
    return found


def documents(source: Path, text_field: str) -> Iterator[str]:
    """The texts of one source, in order."""
    if source.is_dir() or source.suffix in JSON_LINES + PARQUET:
        for text, where in records(source, text_field):
            yield _checked_text(text, text_field, where)
        return
    try:
        yield source.read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise JlongError(f"cannot read {str(source)!r}: {err.strerror or err}") from None


def records(source: Path, field: str) -> Iterator[tuple[object, str]]:
    """(value of `field`, where it was read) of each record of a JSON Lines,
    Parquet or `datasets` source, in order."""
    for (value,), where in rows(source, (field,), FIELD_HINT):
        yield value, where


def rows(source: Path, fields: tuple[str, ...], hint: str) -> Iterator[tuple[tuple, str]]:
    """(the values of `fields`, where they were read) of each record of a JSON
    Lines, Parquet or `datasets` source, in order; a record or table without
    one of them is refused in one line that ends with `hint`."""
    if source.is_dir():
        yield from _saved_dataset(source, fields, hint)
    elif source.suffix in JSON_LINES:
        yield from _json_lines(source, fields, hint)
    elif source.suffix in PARQUET:
        yield from _parquet(source, fields, hint)
    else:
        raise JlongError(f"{str(source)!r} holds no records: give JSON Lines, Parquet or a 'datasets' directory")


def whole_records(source: Path) -> Iterator[tuple[dict, str]]:
    """(every field of a record, where it was read) of each record of a JSON
    Lines, Parquet or `datasets` source (a file or a datasets directory), in order."""
    if source.is_dir():
        if not _is_saved_dataset(source):
            raise JlongError(f"{str(source)!r} is a directory but no 'datasets' directory (save_to_disk)")
        columns = _saved_dataset_columns(source)
    elif source.suffix in PARQUET:
        import pyarrow.parquet as pq

        try:
            columns = pq.ParquetFile(source).schema_arrow.names
        except Exception as err:  # pyarrow's errors for a file that is not Parquet
            raise JlongError(f"cannot read {str(source)!r} as Parquet ({err})") from None
    elif source.suffix in JSON_LINES:
        yield from _json_lines_whole(source)
        return
    elif not source.exists():
        raise JlongError(f"{str(source)!r} does not exist")
    else:
        raise JlongError(f"{str(source)!r} holds no records: give JSON Lines (.jsonl), Parquet or a 'datasets' "
                         "directory")
    for values, where in rows(source, tuple(columns), ""):
        yield dict(zip(columns, values)), where


def _json_lines_whole(path: Path) -> Iterator[tuple[dict, str]]:
    try:
        with path.open(encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                where = f"{str(path)!r} line {number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise JlongError(f"{where} is not JSON ({err.msg})") from None
                if not isinstance(record, dict):
                    raise JlongError(f"{where} is not a JSON object")
                yield record, where
    except OSError as err:
        raise JlongError(f"cannot read {str(path)!r}: {err.strerror or err}") from None


def _saved_dataset_columns(path: Path) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise JlongError(f"{str(path)!r} is a 'datasets' directory: pip install datasets") from None
    try:
        return datasets.load_from_disk(str(path)).column_names
    except Exception as err:  # datasets raises several kinds for a damaged directory
        raise JlongError(f"cannot load {str(path)!r} with datasets.load_from_disk ({err})") from None


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "state.json").is_file()


def _json_lines(path: Path, fields: tuple[str, ...], hint: str) -> Iterator[tuple[tuple, str]]:
    try:
        with path.open(encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise JlongError(f"{str(path)!r} line {number} is not JSON ({err.msg})") from None
                where = f"{str(path)!r} line {number}"
                missing = [field for field in fields if not isinstance(record, dict) or field not in record]
                if missing:
                    raise JlongError(f"{where} has no field {missing[0]!r}; {hint}")
                yield tuple(record[field] for field in fields), where
    except OSError as err:
        raise JlongError(f"cannot read {str(path)!r}: {err.strerror or err}") from None


def _parquet(path: Path, fields: tuple[str, ...], hint: str) -> Iterator[tuple[tuple, str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow's errors for a file that is not Parquet
        raise JlongError(f"cannot read {str(path)!r} as Parquet ({err})") from None
    _check_columns(path, fields, table.schema_arrow.names, hint)
    row = 0
    for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=list(fields)):
        for values in zip(*(batch.column(i).to_pylist() for i in range(len(fields)))):
            yield values, f"{str(path)!r} row {row}"
            row += 1


def _saved_dataset(path: Path, fields: tuple[str, ...], hint: str) -> Iterator[tuple[tuple, str]]:
    try:
        import datasets
    except ImportError:
        raise JlongError(f"{str(path)!r} is a 'datasets' directory: pip install datasets") from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises several kinds for a damaged directory
        raise JlongError(f"cannot load {str(path)!r} with datasets.load_from_disk ({err})") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise JlongError(f"{str(path)!r} holds several splits ({', '.join(dataset)}); give one split's directory")
    _check_columns(path, fields, dataset.column_names, hint)
    for row, record in enumerate(dataset.select_columns(list(fields))):
        yield tuple(record[field] for field in fields), f"{str(path)!r} row {row}"


def _check_columns(path: Path, fields: tuple[str, ...], columns: list[str], hint: str) -> None:
    missing = [field for field in fields if field not in columns]
    if missing:
        raise JlongError(f"{str(path)!r} has no column {missing[0]!r} (its columns: {', '.join(columns)}); {hint}")


def _checked_text(text, field: str, where: str) -> str:
    if not isinstance(text, str):
        raise JlongError(f"{where}: field {field!r} is {type(text).__name__}, not text")
    return text
