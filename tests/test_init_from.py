"""train.init_from: step 1 from another run's weights (any mesh) or a Hugging
Face directory, with a fresh optimizer, at whatever length and layout the
new run is configured for; weights of another model are refused in one line."""

import shutil

import jax
import numpy as np
import pytest
from helpers import assert_one_line_error, run_cli, run_config
from hf_models import small_hf_model

from jlong.config import config_to_dict, load_config
from jlong.data.sources import Batches
from jlong.parallel.placement import make_mesh
from jlong.program.optimizer import learning_rate
from jlong.program.train_program import TrainProgram
from jlong.init_from import check_init_from
from jlong.training.loop import train

LONGER_ON_A_RING = ["train.seq_len=128", "mesh.fsdp=1", "mesh.ring=2", "mesh.sp=4"]


@pytest.fixture(scope="module")
def shorter_run(tmp_path_factory):
    """Three steps at 64 tokens on fsdp 2 x sp 4, checkpointed at the end."""
    tmp = tmp_path_factory.mktemp("short")
    train(run_config(tmp, "train.steps=3"))
    return tmp / "ckpt"


def _first_loss_on_one_device(config) -> float:
    """The loss of the starting weights on the run's first batch, on one device."""
    one = load_config(None, ["mesh.fsdp=1", "mesh.ring=1", "mesh.sp=1"], base=config_to_dict(config))
    program = TrainProgram(one, make_mesh(one.mesh, jax.devices()[:1]))
    params = program.load_initial_weights(check_init_from(one))
    return float(jax.jit(program.loss)(params, program.place_batch(Batches.from_config(one).batch(1))))


def test_a_run_continues_another_runs_weights_at_a_longer_length_on_another_mesh(shorter_run, tmp_path, capsys):
    config = run_config(tmp_path, f"train.init_from={shorter_run}", *LONGER_ON_A_RING, "train.steps=2")
    records = train(config)
    said = capsys.readouterr().out
    assert f"starting at step 1 from the weights of step 3 in {shorter_run} (a fresh optimizer) (no checkpoint in " \
        f"{tmp_path / 'ckpt'})" in said
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["lr"] == pytest.approx(float(learning_rate(config.train, 1)))  # the schedule starts again
    np.testing.assert_allclose(records[0]["loss"], _first_loss_on_one_device(config), rtol=1e-5)

    # Once the run has checkpoints of its own it resumes from them; the source is not read again.
    moved = shutil.move(str(shorter_run), str(tmp_path / "gone"))
    try:
        resumed = train(run_config(tmp_path, f"train.init_from={shorter_run}", *LONGER_ON_A_RING, "train.steps=3"))
    finally:
        shutil.move(moved, str(shorter_run))
    assert [r["step"] for r in resumed] == [3]


@pytest.mark.parametrize("family", ["llama", "qwen3.5"])
def test_hugging_face_weights_start_a_run_as_model_hf_path_does(family, tmp_path):
    small_hf_model(family).save_pretrained(tmp_path / "hf")
    common = ["train.steps=1", "train.seq_len=32", "train.batch_size=2", "train.compute_dtype=float32",
              "data.source=synthetic", "mesh.fsdp=2", "mesh.sp=4"]
    by_hf_path = load_config(None, [*common, f"model.hf_path={tmp_path / 'hf'}"])
    inline = {**config_to_dict(by_hf_path)["model"], "hf_path": None}
    by_init_from = load_config(None, [*common, f"train.init_from={tmp_path / 'hf'}"],
                               base={"model": inline})
    assert train(by_init_from)[0]["loss"] == train(by_hf_path)[0]["loss"]


def test_weights_of_another_model_are_refused_before_anything_is_built(shorter_run, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("{}\n")
    shape = ["model.vocab_size=128", "model.hidden_size=32", "model.intermediate_size=128",
             "model.num_hidden_layers=2", "model.num_attention_heads=8", "model.num_key_value_heads=4",
             "train.seq_len=64", "train.batch_size=8", "data.source=synthetic", "mesh.fsdp=2", "mesh.sp=4"]
    result = run_cli("train", config, *shape, f"train.init_from={shorter_run}", f"run_dir={tmp_path / 'run'}")
    assert_one_line_error(result, f"train.init_from '{shorter_run}' holds the weights of another model "
                                  "(model.hidden_size 64 there, 32 here)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # nothing written
    small_hf_model("llama").save_pretrained(tmp_path / "hf")
    both = run_cli("train", config, "data.source=synthetic", f"model.hf_path={tmp_path / 'hf'}",
                   f"train.init_from={shorter_run}")
    assert_one_line_error(both, "train.init_from and model.hf_path both name starting weights: keep one")
    assert_one_line_error(run_cli("train", config, *shape, f"train.init_from={tmp_path / 'none'}"),
                          "train.init_from '" + str(tmp_path / "none") + "' is not a directory")
