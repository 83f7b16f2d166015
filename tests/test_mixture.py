"""`data.mix` and `eval.mix`: each batch split across weighted corpora
(stratified, the remainder drawn by the seed), the same for a step whenever
it is read, so a resumed run is the uninterrupted one; what each step drew is
logged and summarised; each source keeps its own end-of-document id; a
held-out mixture is scored by source; bad mixtures are one line."""

import json

import numpy as np
import pytest
from helpers import MESH, SMALL_MODEL, assert_one_line_error, run_cli

from jlong.config import load_config
from jlong.data.mixture import Mixture
from jlong.data.prepare import prepare
from jlong.data.recorded import with_recorded_data
from jlong.data.sources import Batches
from jlong.errors import JlongError
from jlong.training.loop import train

S = 64  # SMALL_MODEL's train.seq_len


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """'long': byte documents of letters a-m; 'short': of letters n-z (so a row tells its source); 'stream': a
    bare .npy of ids 1-9 with no index, whose end-of-document id is 9."""
    tmp = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(0)
    for name, (low, high), lengths in [("long", (97, 110), (100, 400)), ("short", (110, 123), (5, 40))]:
        texts = ["".join(chr(c) for c in rng.integers(low, high, n)) for n in rng.integers(*lengths, 60)]
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        prepare(str(tmp / f"{name}.npy"), [str(tmp / f"{name}.jsonl")])
    np.save(tmp / "stream.npy", rng.integers(1, 10, 5000).astype(np.uint16))
    return tmp


def _mix(sources, *entries, overrides=()):
    mix = json.dumps([{"path": str(sources / f"{name}.npy"), **extra} for name, extra in entries])
    return load_config(None, [*SMALL_MODEL, "model.vocab_size=256", "data.source=tokens", "data.eos_id=0",
                              f"data.mix={mix}", *overrides])


def _source_of(row: np.ndarray) -> str:
    letters = row[(row >= 97) & (row < 123)]
    if not len(letters):
        return "stream"
    assert np.all(letters < 110) or np.all(letters >= 110), "a row mixes sources"
    return "long" if letters[0] < 110 else "short"


@pytest.mark.fast
def test_each_step_draws_the_weights_share_and_the_remainder_by_the_seed(sources):
    config = _mix(sources, ("long", {"weight": 3}), ("short", {"weight": 1}), overrides=["train.batch_size=5"])
    batches = Batches.from_config(config)
    mixture = batches.source
    assert isinstance(mixture, Mixture)
    steps = range(1, 2001)
    drawn = np.array([mixture.counts(step) for step in steps])
    assert np.all(drawn.sum(axis=1) == 5)
    assert set(map(tuple, drawn)) == {(4, 1), (3, 2)}  # 3.75 and 1.25: never more than one away
    share = drawn[:, 0].sum() / drawn.sum()
    assert abs(share - 0.75) < 0.01  # 3:1 in expectation
    logged = [batches.drawn(step)["tokens_by_source"] for step in steps[:50]]
    assert all(d == {"long": int(c[0]) * S, "short": int(c[1]) * S} for d, c in zip(logged, drawn))
    for step in (1, 2, 3, 17):  # each row really is from the source the counts name
        rows = batches.batch(step)["inputs"]
        assert [_source_of(r) for r in rows] == ["long"] * int(drawn[step - 1, 0]) + ["short"] * int(drawn[step - 1, 1])
    reseeded = Batches.from_config(_mix(sources, ("long", {"weight": 3}), ("short", {"weight": 1}),
                            overrides=["train.batch_size=5", "train.seed=7"])).source
    assert [tuple(reseeded.counts(s)) for s in steps[:40]] != [tuple(c) for c in drawn[:40]]


@pytest.mark.fast
def test_a_step_reads_the_same_batch_whenever_it_is_read(sources):
    config = _mix(sources, ("long", {"weight": 2, "sampling": "documents"}), ("short", {"shuffle": True}),
                  overrides=["train.batch_size=3"])
    first, again = Batches.from_config(config), Batches.from_config(config)
    for step in (40, 1, 2, 39, 200):  # out of order, as a resumed run reads them
        a, b = first.batch(step), again.batch(step)
        assert all(np.array_equal(a[key], b[key]) for key in a)
    # Each source reads its own rows in order: a source's rows of step t follow those of steps before t.
    long_rows = [r.tobytes() for step in range(1, 6) for r in first.batch(step)["inputs"] if _source_of(r) == "long"]
    sampler = first.source.sources[0].sampler
    assert long_rows == [sampler.row(i)[:-1].astype(np.int32).tobytes() for i in range(len(long_rows))]


@pytest.mark.fast
def test_each_source_keeps_its_own_end_of_document_id(sources):
    config = _mix(sources, ("short", {}), ("stream", {"eos_id": 9}), overrides=["train.batch_size=2"])
    batch = Batches.from_config(config).batch(1)
    short, stream = batch["inputs"]
    assert (short == 0).any() and not (short == 9).any()
    ends = np.flatnonzero(stream == 9)
    after = ends[ends + 1 < S] + 1
    assert len(after) and np.all(batch["positions"][1][after] == 0)
    assert np.all(np.diff(batch["segment_ids"][1]) == (stream[:-1] == 9))  # a document starts after each 9


def test_a_run_stopped_mid_mixture_resumes_to_the_uninterrupted_run(sources, tmp_path):
    entries = [("long", {"weight": 3, "sampling": "documents"}), ("short", {"weight": 1})]
    settings = [*MESH, "train.steps=4", "train.warmup_steps=1", "train.lr=1e-2", "train.batch_size=6"]
    whole = train(_mix(sources, *entries, overrides=settings))
    resumed = _mix(sources, *entries, overrides=[*settings, f"run_dir={tmp_path / 'run'}",
                                                 f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2"])
    halves = train(resumed, until_step=2) + train(resumed)
    assert [r["loss"] for r in halves] == [r["loss"] for r in whole]
    assert [r["tokens_by_source"] for r in halves] == [r["tokens_by_source"] for r in whole]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [set(r["tokens_by_source"]) for r in logged] == [{"long", "short"}] * 4
    assert all(sum(r["tokens_by_source"].values()) == 6 * S for r in logged)


def test_the_dry_run_and_the_summary_report_the_realised_mix(sources, tmp_path):
    mix = json.dumps([{"path": str(sources / "long.npy"), "weight": 3},
                      {"path": str(sources / "short.npy"), "name": "chat"}])
    args = [*SMALL_MODEL, *MESH, "model.vocab_size=256", "data.source=tokens", "data.eos_id=0", f"data.mix={mix}",
            "train.steps=4", "train.warmup_steps=1", "train.batch_size=4"]
    config = tmp_path / "run.yaml"
    config.write_text("{}")
    dry = run_cli("train", config, *args, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "a mixture of 2 sources (long:" in dry.stdout and "chat:" in dry.stdout
    assert "steps 1-4 draw long 75.0% (768 tokens), chat 25.0% (256 tokens)" in dry.stdout
    trained = run_cli("train", config, *args)
    assert trained.returncode == 0, trained.stderr
    assert "data mix     long 75.0% (768 tokens), chat 25.0% (256 tokens)" in trained.stdout


def test_a_held_out_mixture_is_scored_by_source(sources, tmp_path):
    mix = json.dumps([{"path": str(sources / "long.npy"), "weight": 3}, {"path": str(sources / "short.npy")}])
    config = _mix(sources, ("long", {}), ("short", {}), overrides=[
        *MESH, "train.steps=2", "train.warmup_steps=1", "train.eval_every=2", f"run_dir={tmp_path / 'run'}",
        f"eval.mix={mix}", "eval.sequences=8"])
    records = train(config)
    by_source = records[-1]["eval_loss_by_source"]
    assert set(by_source) == {"long", "short"} and by_source["long"] != by_source["short"]
    # eval.sequences split 6:2 by weight, so the whole loss is the rows' mean: 3/4 of long's and 1/4 of short's
    assert records[-1]["eval_loss"] == pytest.approx(0.75 * by_source["long"] + 0.25 * by_source["short"], rel=1e-6)


@pytest.mark.parametrize("mix, extra, message", [
    ([{"path": "long", "weight": 0}], [], "data.mix[0].weight must be positive"),
    ([{"path": "long", "weight": -2}], [], "data.mix[0].weight must be positive"),
    ([{"path": "long"}, {"path": "long"}], [], "data.mix names 'long' more than once"),
    ([{"path": "long", "ratio": 2}], [], "data.mix[0].ratio is not a setting of a mixture's entry"),
    ([{"weight": 2}], [], "data.mix[0].path is required"),
    ([{"path": "nowhere"}], [], "data.mix[0].path '{dir}/nowhere.npy' does not exist"),
    ([{"path": "long"}], ["data.path={dir}/short.npy"], "data.mix replaces data.path"),
    ([{"path": "long", "eos_id": 300}], [], "data.mix[0].eos_id (300) is outside the model's vocabulary"),
    ([], [], "data.mix is empty"),
])
@pytest.mark.fast
def test_a_bad_mixture_is_one_line(sources, tmp_path, mix, extra, message):
    entries = [{**e, "path": f"{sources}/{e['path']}.npy"} if "path" in e else e for e in mix]
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"data": {"source": "tokens", "eos_id": 0, "mix": entries}}))
    result = run_cli("train", config, *SMALL_MODEL, "model.vocab_size=256", "data.source=tokens",
                     *(e.format(dir=sources) for e in extra))
    assert_one_line_error(result, message.format(dir=sources))


@pytest.mark.fast
def test_a_mixture_needs_token_data_and_end_ids_where_it_packs_documents(sources):
    with pytest.raises(JlongError, match="data.mix mixes token corpora: set data.source=tokens"):
        _mix(sources, ("long", {}), overrides=["data.source=synthetic"])
    unrecorded = _mix(sources, ("stream", {"sampling": "documents"}), overrides=["data.eos_id=null"])
    with pytest.raises(JlongError, match=r"data.mix\[0\].path samples documents, but .* records no end-of-document "
                                         r"id: set data.eos_id"):
        with_recorded_data(unrecorded)
    recorded = with_recorded_data(_mix(sources, ("long", {"sampling": "documents"}), overrides=["data.eos_id=null"]))
    assert recorded.data.eos_id == 0 and recorded.data.loss_mask is False  # as prepare recorded it
