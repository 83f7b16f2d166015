"""The sizes and checksums each process lists for the files it writes into a
checkpoint step, and `jlong verify`, on step directories laid out as orbax
lays them out (no orbax, no training: see test_checkpoint_faults.py for
damaged checkpoints of real runs)."""

import json
from pathlib import Path

import pytest
from helpers import assert_one_line_error, run_cli

from jlong.checkpoint_integrity import FILE_LIST, find_damage, has_checksums, list_name, record_files

pytestmark = pytest.mark.fast

# Two processes' files: each writes its arrays' data and metadata; process 0 also everything shared.
FILES = {
    "_CHECKPOINT_METADATA": 0,
    "params/_METADATA": 0,
    "params/manifest.ocdbt": 0,
    "params/ocdbt.process_0/d/aa11": 0,
    "params/ocdbt.process_1/d/bb22": 1,
    "params/array_metadatas/process_1": 1,
}


def _step(directory: Path, step: int = 3, processes: int = 2) -> Path:
    """A step written by `processes` processes, each listing its own files."""
    step_dir = directory / str(step)
    for number, name in enumerate(FILES):
        (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / name).write_bytes(bytes(range(256)) * (number + 1))
    for process in range(processes):
        record_files(step_dir, process, processes)
    return step_dir


def _flip_middle_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_each_process_lists_the_files_it_wrote(tmp_path):
    step_dir = _step(tmp_path)
    for process in (0, 1):
        listed = json.loads((step_dir / list_name(process)).read_text())
        assert sorted(listed["files"]) == sorted(name for name, writer in FILES.items() if writer == process)
        assert all(len(crc) == 8 for _, crc in listed["files"].values())
    assert json.loads((step_dir / FILE_LIST).read_text())["processes"] == 2
    assert find_damage(step_dir) is None and has_checksums(step_dir)


def test_a_flipped_bit_is_found_by_the_reader_whose_share_holds_it(tmp_path):
    """Reader r of R checks the lists of writers r, r + R, ...: any number of either."""
    step_dir = _step(tmp_path)
    _flip_middle_byte(step_dir / "params/ocdbt.process_1/d/bb22")
    found = find_damage(step_dir)
    assert found.startswith("params/ocdbt.process_1/d/bb22 changed after it was written (CRC-32 ")
    assert find_damage(step_dir, 1, 2) == find_damage(step_dir, 1, 4) == found
    assert find_damage(step_dir, 0, 2) is find_damage(step_dir, 3, 4) is None


def test_a_lost_list_or_file_is_named(tmp_path):
    step_dir = _step(tmp_path)
    (step_dir / "params/_METADATA").unlink()
    assert find_damage(step_dir) == "params/_METADATA is missing"
    (step_dir / list_name(1)).unlink()
    assert find_damage(step_dir, 1, 2) == "jlong_files.process_1.json (process 1's list of its files) is missing"


def test_a_step_listed_by_an_older_jlong_is_checked_for_size(tmp_path):
    """Before checksums, process 0 listed the size of every file."""
    step_dir = _step(tmp_path, processes=1)
    (step_dir / FILE_LIST).write_text(json.dumps({n: (step_dir / n).stat().st_size for n in FILES}))
    assert not has_checksums(step_dir)
    _flip_middle_byte(step_dir / "params/ocdbt.process_0/d/aa11")  # not seen: no checksum to compare
    result = run_cli("verify", tmp_path)
    assert result.returncode == 0
    assert result.stdout == f"{str(tmp_path)!r}: step 3 has no checksums (not checked byte for byte)\n"
    (step_dir / "params/_METADATA").write_bytes(b"")
    assert find_damage(step_dir).startswith("params/_METADATA holds 0 bytes, ")


def test_verify_names_each_damaged_step_in_one_line(tmp_path):
    for step in (2, 4):
        _step(tmp_path, step)
    intact = run_cli("verify", tmp_path)
    assert (intact.returncode, intact.stdout) == (0, f"{str(tmp_path)!r}: steps 2, 4 intact\n")
    _flip_middle_byte(tmp_path / "4" / "params/manifest.ocdbt")
    assert_one_line_error(run_cli("verify", tmp_path),
                          f"{str(tmp_path)!r}: damaged, step 4: params/manifest.ocdbt changed after it was written")
    assert_one_line_error(run_cli("verify", tmp_path / "4"), "holds no checkpoint steps")
    assert_one_line_error(run_cli("verify", tmp_path / "absent"), "is not a directory")


def test_a_list_that_is_no_list_names_the_step_damaged(tmp_path):
    step_dir = _step(tmp_path)
    (step_dir / list_name(1)).write_text('{"checksum": "crc32"}')
    assert find_damage(step_dir) == ("jlong_files.process_1.json (process 1's list of its files) cannot be read: "
                                     "not a list of files")
    (step_dir / FILE_LIST).write_text("[]")
    assert find_damage(step_dir) == f"its {FILE_LIST} cannot be read: not a list of files"
