"""`data.sampling: documents`: sequences packed from whole documents, long
ones up-sampled, the same for a step whenever it is read, and a resumed run
reads exactly the batches an uninterrupted one does."""

import json

import numpy as np
import pytest
from helpers import MESH, SMALL_MODEL

from jlong.config import load_config
from jlong.data.documents import PackedDocuments
from jlong.data.prepare import prepare
from jlong.data.sources import Batches
from jlong.errors import JlongError
from jlong.training.loop import train

S = 64  # SMALL_MODEL's train.seq_len


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Byte documents of many lengths: short ones, ones near S, and two of several windows."""
    tmp = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    lengths = [*rng.integers(3, 40, 30), 63, 64, 65, 200, 333]
    texts = ["".join(chr(c) for c in rng.integers(97, 123, n)) for n in lengths]  # no two windows alike
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prepare(str(tmp / "docs.npy"), [str(tmp / "docs.jsonl")])
    return tmp / "docs.npy"


def _config(corpus, *overrides):
    return load_config(None, [*SMALL_MODEL, "model.vocab_size=256", "data.source=tokens", f"data.path={corpus}",
                              "data.eos_id=0", "data.sampling=documents", *overrides])


def _rows(source: PackedDocuments, count: int) -> list[bytes]:
    return [source.row(i).tobytes() for i in range(count)]


@pytest.mark.fast
def test_sequences_are_whole_documents_packed_and_each_piece_drawn_once_a_pass(corpus):
    source = Batches.from_config(_config(corpus)).source
    tokens = np.load(corpus)
    rows = [source.row(i) for i in range(source.per_epoch)]
    assert all(len(r) == S + 1 for r in rows)
    # A document of at least S + 1 tokens gives whole windows, each a sequence of its own, once a pass.
    windows = [tokens[s : s + S + 1] for s, n in zip(source.piece_starts, source.piece_lengths) if n == S + 1]
    # documents (with their end id) of 65, 66, 201 and 334 tokens: 1 + 1 + 3 + 5 windows of 65, and tails
    assert len(windows) == 10
    for window in windows:
        assert sum(np.array_equal(r, window) for r in rows) == 1
    # Every other row is short pieces end to end: it holds end ids, and each document in it restarts after one.
    packed = [r for r in rows if not any(np.array_equal(r, w) for w in windows)]
    assert len(packed) == source.per_epoch - len(windows) and all((r == 0).any() for r in packed)


@pytest.mark.fast
def test_long_documents_are_drawn_as_often_as_their_weight(corpus):
    plain = Batches.from_config(_config(corpus)).source
    tripled = Batches.from_config(_config(corpus, "data.long_document_weight=3")).source
    tokens = np.load(corpus)
    window = tokens[plain.piece_starts[-1] - 4 * (S + 1) : plain.piece_starts[-1] - 3 * (S + 1)]  # of the 333
    assert len(window) == S + 1
    count = sum(np.array_equal(tripled.row(i), window) for i in range(tripled.per_epoch))
    assert count == 3 and tripled.per_epoch > plain.per_epoch


@pytest.mark.fast
def test_a_step_reads_the_same_batch_whenever_it_is_read(corpus):
    config = _config(corpus, "train.batch_size=4")
    first, again = Batches.from_config(config), Batches.from_config(config)
    passes = 3 * first.source.per_epoch // 4 + 1  # steps into the third pass
    for step in (passes, 1, 2, passes - 1):  # out of order, as a resumed run reads them
        a, b = first.batch(step), again.batch(step)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(first.batch(1)["inputs"], first.batch(1 + first.source.per_epoch // 4)["inputs"])


def test_a_resumed_run_reads_and_learns_exactly_as_an_uninterrupted_one(corpus, tmp_path):
    overrides = [*MESH, "train.steps=4", "train.warmup_steps=1", "train.lr=1e-2", "data.long_document_weight=2.5"]
    whole = [r["loss"] for r in train(_config(corpus, *overrides))]
    resumed = _config(corpus, *overrides, f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2")
    halves = train(resumed, until_step=2) + train(resumed)
    assert [r["loss"] for r in halves] == whole


@pytest.mark.parametrize("overrides, message", [
    (["data.source=synthetic", "data.path=null"],
     "data.sampling=documents packs documents of a token file: it needs data.source=tokens"),
    (["data.long_document_weight=0.5"], "data.long_document_weight (0.5) must be at least 1"),
])
@pytest.mark.fast
def test_document_sampling_needs_documents(corpus, overrides, message):
    with pytest.raises(JlongError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(corpus, *overrides)
