"""A corpus in shards: `jlong prepare` writes shards of whole documents (by
size or one per input, numbered after those already there), `data.path`
reads a directory of them as one corpus, in place, and a run on three shards
is the run on the same ids in one file; a bad shard directory is one line."""

import json

import numpy as np
import pytest
from helpers import MESH, SMALL_MODEL, assert_one_line_error, run_cli

from jlong.config import load_config
from jlong.data.corpus import TokenCorpus, index_paths
from jlong.data.prepare import prepare
from jlong.data.sources import Batches
from jlong.training.loop import train

S = 64  # SMALL_MODEL's train.seq_len


def _texts(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(chr(c) for c in rng.integers(97, 123, n)) for n in rng.integers(5, 150, count)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Three JSON Lines files of byte documents."""
    tmp = tmp_path_factory.mktemp("inputs")
    paths = []
    for i in range(3):
        path = tmp / f"input{i}.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(i, 40)))
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def corpora(inputs, tmp_path_factory):
    """The inputs prepared as one file, as shards of about 1,500 tokens, and as one shard per input."""
    tmp = tmp_path_factory.mktemp("corpora")
    prepare(str(tmp / "whole.npy"), inputs)
    by_size = prepare(str(tmp / "by_size"), inputs, shard_tokens=1500)
    per_input = prepare(str(tmp / "per_input"), inputs, shard_per_input=True)
    return {"whole": tmp / "whole.npy", "by_size": tmp / "by_size", "per_input": tmp / "per_input",
            "summaries": {"by_size": by_size, "per_input": per_input}}


@pytest.mark.fast
def test_shards_hold_whole_documents_and_join_to_the_single_file(corpora):
    whole = np.load(corpora["whole"])
    shards = sorted(corpora["by_size"].glob("part-*[0-9].npy"))
    assert [p.name for p in shards] == [f"part-{i:05d}.npy" for i in range(len(shards))] and len(shards) >= 3
    joined = np.concatenate([np.load(p) for p in shards])
    assert np.array_equal(joined, whole)
    for shard in shards:
        ids = np.load(shard)
        assert ids[-1] == 0  # ends with an end-of-document id: no document is split between shards
        starts = np.load(index_paths(shard)["npy"])
        assert starts[0] == 0 and np.all(ids[starts[1:] - 1] == 0)
        assert len(ids) - 150 <= 1500 or len(starts) == 1  # filled to the size, overshooting by under a document
    summary = corpora["summaries"]["by_size"]
    assert summary["tokens"] == len(whole) and summary["shards"] == [str(p) for p in shards]


@pytest.mark.fast
def test_one_shard_per_input_and_more_shards_are_numbered_after_those_there(corpora, inputs, tmp_path):
    shards = sorted(corpora["per_input"].glob("part-*[0-9].npy"))
    assert len(shards) == 3
    for shard, source in zip(shards, inputs):
        alone = tmp_path / (shard.stem + ".npy")
        prepare(str(alone), [source])
        assert np.array_equal(np.load(shard), np.load(alone))
    directory = tmp_path / "growing"
    prepare(str(directory), inputs[:2], shard_per_input=True)
    added = prepare(str(directory), inputs[2:], shard_per_input=True)
    assert [p.split("/")[-1] for p in added["shards"]] == ["part-00002.npy"]
    assert np.array_equal(TokenCorpus(str(directory))[:], TokenCorpus(str(corpora["per_input"]))[:])


@pytest.mark.fast
def test_a_shard_directory_reads_as_one_corpus(corpora):
    whole = np.load(corpora["whole"])
    corpus = TokenCorpus(str(corpora["by_size"]))
    assert len(corpus) == len(whole)
    bounds = corpus.offsets[1:-1]
    for start in [0, *(b - 3 for b in bounds), len(whole) - 10]:  # slices across every boundary
        assert np.array_equal(corpus[start : start + 20], whole[start : start + 20])
    assert np.array_equal(corpus.document_starts(0), np.load(index_paths(corpora["whole"])["npy"]))
    assert all(isinstance(a, np.memmap) for a in corpus.arrays)  # read in place
    listed = TokenCorpus([str(p) for p in sorted(corpora["per_input"].glob("part-*[0-9].npy"))])
    assert np.array_equal(listed[:], whole)


def _config(path, *overrides):
    return load_config(None, [*SMALL_MODEL, "model.vocab_size=256", "data.source=tokens", f"data.path={path}",
                              "data.eos_id=0", *overrides])


@pytest.mark.fast
@pytest.mark.parametrize("sampling", ["windows", "documents"])
def test_batches_from_shards_are_the_batches_from_one_file(corpora, sampling):
    settings = [f"data.sampling={sampling}", "data.shuffle=true", "train.batch_size=4"]
    one = Batches.from_config(_config(corpora["whole"], *settings))
    sharded = Batches.from_config(_config(corpora["by_size"], *settings))
    for step in (1, 2, 7, 30):  # into later passes: shuffling spans the shards
        a, b = one.batch(step), sharded.batch(step)
        assert all(np.array_equal(a[key], b[key]) for key in a)


def test_a_corpus_in_three_shards_trains_as_the_same_corpus_in_one_file(corpora):
    settings = [*MESH, "train.steps=3", "train.warmup_steps=1", "train.lr=1e-2", "data.sampling=documents",
                "data.shuffle=true"]
    one = [r["loss"] for r in train(_config(corpora["whole"], *settings))]
    three = [r["loss"] for r in train(_config(corpora["per_input"], *settings))]
    assert three == one


def _shard_directory(tmp_path, name, inputs, *options):
    directory = tmp_path / name
    for source, extra in zip(inputs, options):
        prepare(str(directory), [source], shard_per_input=True, **extra)
    return directory


def _bad_shard_directories(tmp_path, inputs):
    mixed_eos = _shard_directory(tmp_path, "mixed_eos", inputs[:2], {}, {"eos_id": 10})
    gap = _shard_directory(tmp_path, "gap", inputs, {}, {}, {})
    for path in index_paths(gap / "part-00001.npy").values():
        path.unlink()
    (gap / "part-00001.npy").unlink()
    lost = _shard_directory(tmp_path, "lost", inputs[:2], {}, {})
    (lost / "part-00001.npy").unlink()
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "mixed end ids": (mixed_eos, "mixes token files prepared with different eos_ids: part-00000.npy has 0, "
                                     "part-00001.npy has 10"),
        "a gap": (gap, "is missing the shard part-00001.npy between part-00000.npy and part-00002.npy"),
        "an index without its shard": (lost, "is missing the shard part-00001.npy (its index "
                                             "part-00001.documents.npy is there)"),
        "no shards": (empty, "holds no token files"),
    }


def test_a_bad_shard_directory_is_one_line_before_anything_compiles(tmp_path, inputs):
    for name, (directory, message) in _bad_shard_directories(tmp_path, inputs).items():
        config = tmp_path / f"{name.replace(' ', '_')}.yaml"
        config.write_text(json.dumps({"data": {"source": "tokens", "path": str(directory), "eos_id": 0}}))
        result = run_cli("train", config, *SMALL_MODEL, "model.vocab_size=256", "data.source=tokens")
        assert_one_line_error(result, message)
        assert "compil" not in result.stdout, name


@pytest.mark.fast
def test_shards_prepared_with_different_vocabularies_are_refused(tmp_path, inputs):
    directory = tmp_path / "mixed_vocab"
    prepare(str(directory), inputs[:1], shard_per_input=True)
    summary = index_paths(directory / "part-00000.npy")["json"]
    facts = json.loads(summary.read_text())
    prepare(str(directory), inputs[1:2], shard_per_input=True)
    summary.write_text(json.dumps({**facts, "vocab_size": 32000}))  # as a shard from another tokenizer says
    with pytest.raises(Exception, match="different vocab_sizes: part-00000.npy has 32000, part-00001.npy has 256"):
        TokenCorpus(str(directory))
