"""Checkpoints that go bad and writes that fail: a damaged newest checkpoint
(truncated, or a byte changed in place) is named, set aside, and the one
before resumes the run exactly; none readable, or one of another layout, is
a one-line error; a failed write stops the run with exit status 1, its
cause named, its temporary directory removed and the previous checkpoint
intact, and the next run says it. And host memory is checked against what
the node has before the first step."""

import json
import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import yaml
from helpers import assert_one_line_error, logged_losses, run_cli, run_config, small_config, train_command

from jlong.checkpoint import FAILED_SAVE, RUN_RECORD, Checkpoints
from jlong.checkpoint_integrity import FILE_LIST
from jlong.config import config_to_dict
from jlong.errors import JlongError, RunFailure
from jlong.parallel.placement import make_mesh
from jlong.training.host_memory import available_bytes, check_host_memory
from jlong.training.loop import host_bytes_per_node, train
from jlong.program.train_program import TrainProgram

# A checkpoint that fails to read leaves orbax's reader coroutines to report it as they are collected, which
# jlong keeps out of stderr; pytest's own hook would still list each as a warning.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return [r["loss"] for r in train(run_config(tmp_path_factory.mktemp("full")))]


def _largest_file(step_dir: Path) -> Path:
    """The step's largest file: orbax's (zstd-compressed) data of several arrays."""
    return max((f for f in step_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _truncate_largest_file(step_dir: Path) -> None:
    largest = _largest_file(step_dir)
    with largest.open("r+b") as f:
        f.truncate(largest.stat().st_size // 2)


def _flip_in_largest_file(step_dir: Path, mask: int) -> Path:
    """XORs the middle byte of the step's largest file with `mask` (its size unchanged); the file's path."""
    largest = _largest_file(step_dir)
    with largest.open("r+b") as f:
        f.seek(largest.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ mask]))
    return largest


@pytest.mark.parametrize("listed", [True, False], ids=["found-by-its-file-list", "found-by-reading"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes(listed, tmp_path, uninterrupted,
                                                                             capsys):
    """Truncated after it was written: the sizes listed at the write show it
    before anything is read; without that list (a checkpoint written by
    another tool), reading it fails, with the same outcome."""
    config = run_config(tmp_path, "checkpoint.every=2", "checkpoint.keep=3")
    train(config, until_step=4)
    if not listed:
        (tmp_path / "ckpt" / "4" / FILE_LIST).unlink()
    _truncate_largest_file(tmp_path / "ckpt" / "4")
    capsys.readouterr()
    continued = train(config)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(f"checkpoint step 4 in {str(tmp_path / 'ckpt')!r} cannot be read (")
    assert ("when it was written" in said[0]) == listed
    assert said[0].endswith("moved it to 4.unreadable, resuming from step 2")
    assert [r["step"] for r in continued] == [3, 4, 5, 6]
    assert logged_losses(tmp_path / "run") == uninterrupted
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "4", "4.unreadable", "6", RUN_RECORD]


@pytest.mark.parametrize("mask", [0xFF, 0x01], ids=["byte-flipped", "low-bit-flipped"])
def test_a_checkpoint_changed_in_place_is_named_set_aside_and_the_one_before_resumes(mask, tmp_path,
                                                                                    uninterrupted, capsys):
    """A byte, or only its lowest bit (which in a float's mantissa would
    train on without a NaN to tell), changed in the middle of the newest
    step's largest array file, its size unchanged: its checksum names it
    before anything is read."""
    config = run_config(tmp_path, "checkpoint.every=2", "checkpoint.keep=3")
    train(config, until_step=4)
    step_dir = tmp_path / "ckpt" / "4"
    damaged = _flip_in_largest_file(step_dir, mask).relative_to(step_dir)
    assert_one_line_error(run_cli("verify", tmp_path / "ckpt"),
                          f"damaged, step 4: {damaged} changed after it was written (CRC-32 ")
    reader = Checkpoints(tmp_path / "ckpt")  # as `jlong eval`, `jlong convert` and train.init_from read a step
    with pytest.raises(JlongError, match=f"checkpoint step 4 in .* is damaged \\({re.escape(str(damaged))} changed"):
        reader.restore(4, abstract_params=None)  # refused before the arrays' layout is even looked at
    reader.close()
    capsys.readouterr()
    continued = train(config)
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(f"checkpoint step 4 in {str(tmp_path / 'ckpt')!r} cannot be read "
                              f"({damaged} changed after it was written (CRC-32 ")
    assert said[0].endswith("moved it to 4.unreadable, resuming from step 2")
    assert said[1] == f"resuming step 2 from {tmp_path / 'ckpt'}"
    assert [r["step"] for r in continued] == [3, 4, 5, 6]
    assert logged_losses(tmp_path / "run") == uninterrupted
    assert (tmp_path / "ckpt" / "4.unreadable" / damaged).is_file()  # kept for inspection
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "4", "4.unreadable", "6", RUN_RECORD]
    verified = run_cli("verify", tmp_path / "ckpt")
    assert verified.returncode == 0
    assert verified.stdout == f"{str(tmp_path / 'ckpt')!r}: steps 2, 4, 6 intact (4.unreadable set aside by a run: " \
                              "not checked)\n"


def test_a_checkpoint_from_before_checksums_restores_and_says_so_once(tmp_path, uninterrupted, capsys):
    """Its file list holds sizes alone, as jlong wrote it then."""
    config = run_config(tmp_path, "checkpoint.every=2")
    train(config, until_step=4)
    step_dir = tmp_path / "ckpt" / "4"
    listed = json.loads((step_dir / FILE_LIST).read_text())["files"]
    (step_dir / FILE_LIST).write_text(json.dumps({name: size for name, (size, _) in listed.items()}))
    capsys.readouterr()
    train(config)
    said = capsys.readouterr().out.splitlines()
    unchecked = [line for line in said if "no checksums" in line]
    assert unchecked == [f"checkpoint step 4 in {str(tmp_path / 'ckpt')!r} has no checksums of its files (written "
                         "before jlong kept them, or its save was cut short): restored without checking its bytes"]
    assert logged_losses(tmp_path / "run") == uninterrupted


@pytest.mark.fast
def test_restoring_a_step_without_a_file_list_says_so(tmp_path, capsys):
    """What convert, train.init_from and eval read (`Checkpoints.restore`), as a resume does: a step
    whose files were never listed reads unchecked, and says it, on stderr unless told where."""
    model = small_config().model
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save(3, {"w": jnp.arange(4.0)}, model=model)
    (tmp_path / "3" / FILE_LIST).unlink()
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    said = []
    params, _ = checkpoints.restore(3, abstract, say=said.append)
    assert said == [f"checkpoint step 3 in {str(tmp_path)!r} has no checksums of its files (written before jlong "
                    "kept them, or its save was cut short): restored without checking its bytes"]
    assert jnp.array_equal(params["w"], jnp.arange(4.0))
    capsys.readouterr()
    checkpoints.restore(3, abstract)
    assert capsys.readouterr().err == f"jlong: note: {said[0]}\n"
    checkpoints.close()


@pytest.mark.fast
def test_a_save_that_fails_in_jlong_says_so_cleans_up_and_is_recalled_by_the_next_run(tmp_path):
    """A zero-size array, which orbax refuses to write: not the disk's
    fault, so no advice to free space; the temporary step is removed, and
    the next run here says it starts again and why, until a save succeeds."""
    model = small_config().model
    with pytest.raises(RunFailure) as failed:
        Checkpoints(tmp_path).save(5, {"w": jnp.zeros((0, 4)), "b": jnp.ones(4)}, model=model)
    message = str(failed.value)
    assert message.startswith(f"writing the checkpoint of step 5 to {str(tmp_path)!r} failed (Cannot save arrays "
                              "with zero size")
    assert "no earlier checkpoint exists" in message and "report it as a jlong bug" in message
    assert "Free space" not in message and "\n" not in message
    assert [p.name for p in tmp_path.iterdir()] == [FAILED_SAVE]  # no 5.orbax-checkpoint-tmp
    said = []
    rerun = Checkpoints(tmp_path)
    assert rerun.restore_newest_readable(None, None, say=said.append) == (0, None, None)
    assert len(said) == 1 and said[0].startswith(f"the last run in {str(tmp_path)!r} failed to write its checkpoint "
                                                 "of step 5 (Cannot save arrays with zero size")
    assert said[0].endswith("not for lack of space or permissions; this run starts again at step 1 and will likely "
                            "fail the same way at that checkpoint")
    rerun.save(5, {"b": jnp.ones(4)}, model=model)
    assert rerun.failed_save_note(5) is None
    rerun.close()


def test_no_readable_checkpoint_is_a_one_line_error_naming_the_directory(tmp_path):
    """Found by reading (no file list): orbax's threads' reports of the failed read stay out of stderr."""
    train(run_config(tmp_path, "train.steps=2"))
    (tmp_path / "ckpt" / "2" / FILE_LIST).unlink()
    _truncate_largest_file(tmp_path / "ckpt" / "2")
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(config_to_dict(run_config(tmp_path, "train.steps=3"))))
    result = run_cli("train", config_file)
    assert_one_line_error(result, f"no checkpoint in {str(tmp_path / 'ckpt')!r} can be read")


def test_a_checkpoint_of_another_layout_is_refused_and_left_alone(tmp_path):
    """Without a run_dir or a run record to compare configs (a checkpoint
    directory from before records were kept), the checkpoint's own array
    layout tells: the optimizer's state in host memory is laid out per layer."""
    train(run_config(tmp_path, "train.steps=2", "run_dir=null"))
    (tmp_path / "ckpt" / RUN_RECORD).unlink()
    with pytest.raises(JlongError, match="holds opt_state of another layout than this config makes"):
        train(run_config(tmp_path, "train.steps=3", "run_dir=null", "memory.optimizer_offload=true"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2"]


def _with_file_size_limit(command: list[str], limit_bytes: int) -> list[str]:
    """`command` run where writes past `limit_bytes` fail (EFBIG, SIGXFSZ ignored) as on a full disk."""
    shell = 'trap "" XFSZ; ulimit -f "$1"; shift; exec "$@"'
    return ["bash", "-c", shell, "limit", str(max(limit_bytes // 1024, 1)), *command]


def test_a_failed_checkpoint_write_exits_1_and_keeps_the_previous_one(tmp_path, uninterrupted, capsys):
    config = run_config(tmp_path, "checkpoint.every=3")
    train(config, until_step=3)
    largest = max(f.stat().st_size for f in (tmp_path / "ckpt" / "3").rglob("*") if f.is_file())
    command, env = train_command(tmp_path, config)
    failed = subprocess.run(_with_file_size_limit(command, largest // 4), env=env, capture_output=True, text=True,
                            timeout=300)
    assert failed.returncode == 1, failed.stderr[-2000:]
    message = failed.stderr.strip().splitlines()[-1]
    assert message.startswith(f"jlong: error: writing the checkpoint of step 6 to {str(tmp_path / 'ckpt')!r} failed")
    assert "File too large" in message and "step 3 is intact" in message
    assert message.endswith("Free space there (or raise the quota or the file size limit), then run again to resume")
    assert "Traceback" not in failed.stderr
    assert not list((tmp_path / "ckpt").glob("6.orbax-checkpoint-tmp*"))
    capsys.readouterr()
    resumed = train(config)  # from step 3, the one the failed write left
    assert [r["step"] for r in resumed] == [4, 5, 6]
    said = capsys.readouterr().out.splitlines()
    assert said[0].startswith(f"the last run in {str(tmp_path / 'ckpt')!r} failed to write its checkpoint of step 6 (")
    assert "File too large" in said[0] and said[0].endswith("); this run resumes step 3")
    assert logged_losses(tmp_path / "run") == uninterrupted


@pytest.mark.fast
def test_available_host_memory_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2113519616 kB\nMemFree:         1000 kB\nMemAvailable:   1879048192 kB\n")
    assert available_bytes(meminfo) == 1879048192 * 1024
    assert available_bytes(tmp_path / "absent") is None


def test_a_step_that_keeps_more_in_host_memory_than_the_node_has_is_stopped():
    config = run_config(Path("/unused"), "memory.optimizer_offload=true", "memory.remat=offload_inputs")
    program = TrainProgram(config, make_mesh(config.mesh))
    needed = host_bytes_per_node(program, program.compile())
    assert needed >= 3 * 4 * sum(x.size for x in jax.tree.leaves(program.abstract_params))  # masters, 2 moments
    check_host_memory(needed, needed)
    check_host_memory(needed, None)  # no /proc/meminfo: nothing to compare with
    with pytest.raises(JlongError) as stopped:
        check_host_memory(needed, needed - 1)
    message = str(stopped.value)
    assert message.startswith("the train step keeps ") and "set train.check_host_memory=false" in message
    assert "\n" not in message
