"""A run checkpointed on one mesh continues on another (other fsdp / sp /
ring splits, fewer devices, the optimizer in host memory) with the losses of
the uninterrupted run; settings that change the mathematics stay refused."""

import shutil
import subprocess

import numpy as np
import pytest
from helpers import logged_losses, run_config, train_command

from jlong.checkpoint import RUN_RECORD
from jlong.errors import JlongError
from jlong.training.loop import train

FSDP_8 = ["mesh.fsdp=8", "mesh.sp=1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return [r["loss"] for r in train(run_config(tmp_path_factory.mktemp("full")))]


@pytest.fixture(scope="module")
def checkpointed_on_fsdp_8(tmp_path_factory):
    """Steps 1-3 of the run on fsdp=8, checkpointed at step 3."""
    tmp = tmp_path_factory.mktemp("fsdp8")
    train(run_config(tmp, *FSDP_8, "checkpoint.every=3"), until_step=3)
    return tmp


def _copy_of(run, tmp_path):
    """The run and checkpoint directories, moved: a moved run resumes too."""
    shutil.copytree(run, tmp_path, dirs_exist_ok=True)
    return tmp_path


@pytest.mark.parametrize("mesh", [["mesh.fsdp=2", "mesh.sp=4"], ["mesh.fsdp=2", "mesh.ring=2", "mesh.sp=2"]],
                         ids=["fsdp2-sp4", "ring2-sp2-fsdp2"])
def test_a_run_continues_on_another_mesh(mesh, checkpointed_on_fsdp_8, uninterrupted, tmp_path, capsys):
    run = _copy_of(checkpointed_on_fsdp_8, tmp_path)
    continued = train(run_config(run, *mesh))
    assert [r["step"] for r in continued] == [4, 5, 6]
    np.testing.assert_allclose(logged_losses(run / "run"), uninterrupted, rtol=1e-5)
    out = capsys.readouterr().out
    assert f"resuming step 3 from {run / 'ckpt'}" in out
    assert "the layout changed since step 3: mesh.fsdp 8 -> 2" in out


def test_a_run_continues_on_four_devices(checkpointed_on_fsdp_8, uninterrupted, tmp_path):
    """`jlong train` gives the CPU the devices the mesh names: 4 here, 8 before."""
    run = _copy_of(checkpointed_on_fsdp_8, tmp_path)
    command, env = train_command(run, run_config(run, "mesh.fsdp=2", "mesh.sp=2"))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(logged_losses(run / "run"), uninterrupted, rtol=1e-5)


def test_a_checkpoint_of_eight_devices_converts_to_hugging_face_on_one(checkpointed_on_fsdp_8, tmp_path):
    """`jlong convert` reads the fsdp=8 checkpoint whole onto its one device."""
    command, env = train_command(tmp_path, run_config(tmp_path))
    command = [*command[:3], "convert", str(checkpointed_on_fsdp_8 / "ckpt"), str(tmp_path / "hf")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    from jlong.hf import from_hf

    assert from_hf(tmp_path / "hf").config.hidden_size == run_config(tmp_path).model.hidden_size


@pytest.mark.parametrize("change, named", [
    (["train.lr=2e-2"], "train.lr"),
    (["train.seq_len=32"], "train.seq_len"),
    (["memory.optimizer_offload=true"], "memory.optimizer_offload"),
])
def test_settings_that_change_the_mathematics_are_refused(change, named, checkpointed_on_fsdp_8, tmp_path):
    run = _copy_of(checkpointed_on_fsdp_8, tmp_path)
    with pytest.raises(JlongError) as refused:
        train(run_config(run, *FSDP_8, *change))
    message = str(refused.value)
    assert f"belongs to a different configuration: {named} changed" in message and "\n" not in message
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["3", RUN_RECORD]  # nothing touched
