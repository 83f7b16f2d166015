"""Data semantics (DESIGN.md), packed documents, and `jlong prepare`."""

import numpy as np
import pytest

from jlong.config import load_config
from jlong.data.prepare import prepare
from jlong.data.sources import Batches, document_structure
from jlong.errors import JlongError

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)


def test_token_windows_follow_the_contract(tmp_path):
    tokens = np.arange(1000, dtype=np.int32) % 97
    np.save(tmp_path / "t.npy", tokens)
    S, B = 30, 4
    config = load_config(None, ["model.preset=llama3.2-1b", "data.source=tokens", f"data.path={tmp_path / 't.npy'}",
                                f"train.seq_len={S}", f"train.batch_size={B}"])
    batches = Batches.from_config(config)
    samples = (len(tokens) - 1) // S  # 33 whole samples
    for step in (1, 2, 9, 10):
        batch = batches.batch(step)
        for row in range(B):
            i = ((step - 1) * B + row) % samples
            np.testing.assert_array_equal(batch["inputs"][row], tokens[i * S : i * S + S])
            np.testing.assert_array_equal(batch["targets"][row], tokens[i * S + 1 : i * S + S + 1])


def test_shuffle_visits_every_sample_once_per_pass(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(401, dtype=np.int32))
    config = load_config(None, ["model.preset=llama3.2-1b", "data.source=tokens", f"data.path={tmp_path / 't.npy'}",
                                "train.seq_len=10", "train.batch_size=4", "data.shuffle=true"])
    batches = Batches.from_config(config)
    firsts = np.concatenate([batches.batch(step)["inputs"][:, 0] for step in range(1, 11)])
    assert sorted(firsts) == list(range(0, 400, 10))
    assert list(firsts) != sorted(firsts)


def test_document_structure_restarts_at_eos():
    inputs = np.array([[5, 0, 7, 8, 0, 0, 9]])
    structure = document_structure(inputs, eos_id=0)
    np.testing.assert_array_equal(structure["segment_ids"], [[0, 0, 1, 1, 1, 2, 3]])
    np.testing.assert_array_equal(structure["positions"], [[0, 1, 0, 1, 2, 0, 0]])


def test_a_batch_over_the_document_cap_is_a_one_line_error(tmp_path):
    """Nine documents of 10 tokens fit a cap of 9 and not one of 8."""
    np.save(tmp_path / "t.npy", np.tile(np.r_[np.ones(9, np.int32), 0], 9))
    config = ["model.preset=llama3.2-1b", "data.source=tokens", f"data.path={tmp_path / 't.npy'}",
              "train.seq_len=89", "train.batch_size=1", "data.eos_id=0"]
    nine = Batches.from_config(load_config(None, [*config, "attention.max_documents=9"]))
    assert nine.batch(1)["segment_ids"].max() == 8
    with pytest.raises(JlongError) as error:
        Batches.from_config(load_config(None, [*config, "attention.max_documents=8"])).batch(1)
    assert "step 1's batch has a sequence of 9 documents, over attention.max_documents (8)" in str(error.value)
    assert "\n" not in str(error.value)


def test_prepare_writes_bytes_with_document_ends(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.py").write_text("ab")
    (tmp_path / "docs" / "b.py").write_text("é")
    (tmp_path / "docs" / "c.txt").write_text("skipped")
    summary = prepare(str(tmp_path / "out.npy"), [str(tmp_path / "docs")], pattern="*.py")
    tokens = np.load(tmp_path / "out.npy")
    assert list(tokens) == [97, 98, 0, 0xC3, 0xA9, 0]
    assert {k: summary[k] for k in ("sources", "documents", "tokens", "vocab_size", "eos_id")} == {
        "sources": 2, "documents": 2, "tokens": 6, "vocab_size": 256, "eos_id": 0}


def test_synthetic_batches_are_seeded():
    config = load_config(None, ["model.preset=llama3.2-1b", "train.seq_len=16", "train.batch_size=2"])
    a, b = Batches.from_config(config).batch(3), Batches.from_config(config).batch(3)
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["inputs"][:, 1:], a["targets"][:, :-1])


def test_prepare_with_a_tokenizer_json(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, "hello": 2, "world": 3}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("hello world hello")
    summary = prepare(str(tmp_path / "out.npy"), [str(tmp_path / "a.txt")],
                      tokenizer_path=str(tmp_path / "tokenizer.json"), eos_id=1)
    assert list(np.load(tmp_path / "out.npy")) == [2, 3, 2, 1]
    assert summary["vocab_size"] == 4
