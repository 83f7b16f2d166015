"""Checkpoints that go bad and writes that fail: a damaged newest checkpoint
is set aside and the one before resumes the run exactly; none readable, or
one of another layout, is a one-line error; a failed write stops the run with
exit status 1 and the previous checkpoint intact. And host memory is checked
against what the node has before the first step."""

import subprocess
from pathlib import Path

import jax
import pytest
import yaml
from helpers import assert_one_line_error, logged_losses, run_cli, run_config, train_command

from jlong.checkpoint import FILE_LIST, RUN_RECORD
from jlong.config import config_to_dict
from jlong.errors import JlongError
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


def _truncate_largest_file(step_dir: Path) -> None:
    largest = max((f for f in step_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with largest.open("r+b") as f:
        f.truncate(largest.stat().st_size // 2)


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
    assert said[0].endswith("moved it to 4.unreadable and trying the one before")
    assert [r["step"] for r in continued] == [3, 4, 5, 6]
    assert logged_losses(tmp_path / "run") == uninterrupted
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["2", "4", "4.unreadable", "6", RUN_RECORD]


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


def test_a_failed_checkpoint_write_exits_1_and_keeps_the_previous_one(tmp_path, uninterrupted):
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
    assert "Traceback" not in failed.stderr
    resumed = train(config)  # from step 3, the one the failed write left
    assert [r["step"] for r in resumed] == [4, 5, 6]
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
