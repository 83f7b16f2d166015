"""`jlong prepare`: every input format gives the tokens of tokenizing its
texts directly, the document index and length histogram are right, and bad
input is one line with nothing left behind."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import assert_one_line_error, run_cli

from jlong.data.prepare import index_paths, prepare

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)

TEXTS = ["def f(x):\n    return x + 1\n", "hello world, hello tokens", "é and ü are two bytes each", "x" * 70]


def _tokenizer(tmp_path):
    """A small BPE tokenizer trained on the texts, saved as tokenizer.json in a directory with its eos_token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return tokenizer, directory


def _write_inputs(tmp_path) -> dict:
    """The texts in each input format prepare reads."""
    text_dir = tmp_path / "texts"
    text_dir.mkdir()
    for i, text in enumerate(TEXTS):
        (text_dir / f"doc{i}.txt").write_text(text)
    jsonl = tmp_path / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(TEXTS)))
    parquet = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(len(TEXTS))), "body": TEXTS}), parquet, row_group_size=2)
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": TEXTS, "id": list(range(len(TEXTS)))}).save_to_disk(str(saved))
    return {"text files": text_dir, "json lines": jsonl, "parquet": parquet, "datasets": saved}


@pytest.mark.parametrize("tokenized", ["bytes", "tokenizer"])
def test_every_format_gives_the_tokens_of_its_texts(tmp_path, tokenized):
    if tokenized == "tokenizer":
        tokenizer, directory = _tokenizer(tmp_path)
        eos = tokenizer.token_to_id("</s>")
        want = [i for t in TEXTS for i in tokenizer.encode(t, add_special_tokens=False).ids + [eos]]
        options = {"tokenizer_path": str(directory)}  # the directory's tokenizer_config.json names the eos id
    else:
        want = [i for t in TEXTS for i in [*t.encode("utf-8"), 0]]
        options = {}
    for name, source in _write_inputs(tmp_path).items():
        out = tmp_path / f"{name.replace(' ', '-')}.npy"
        summary = prepare(str(out), [str(source)], text_field="body", **options)
        assert np.load(out).tolist() == want, name
        assert summary["documents"] == len(TEXTS) and summary["tokens"] == len(want)


def test_the_document_index_and_histogram_of_a_known_corpus(tmp_path):
    lengths = [1, 2, 3, 5, 8, 100, 1000]  # in bytes; each document is one longer with its end id
    corpus = tmp_path / "known.jsonl"
    corpus.write_text("".join(json.dumps({"text": "a" * n}) + "\n" for n in lengths))
    out = tmp_path / "known.npy"
    summary = prepare(str(out), [str(corpus)])
    paths = index_paths(out)
    starts = np.load(paths["npy"])
    assert starts.tolist() == np.cumsum([0] + [n + 1 for n in lengths])[:-1].tolist()
    tokens = np.load(out)
    assert all(tokens[s - 1] == 0 for s in starts[1:]) and tokens[-1] == 0
    assert json.loads(paths["json"].read_text()) == summary
    # document lengths 2, 3, 4, 6, 9, 101, 1001 in [1,2), [2,4), [4,8), ... [512,1024)
    assert summary["histogram"]["edges"] == [1 << k for k in range(11)]
    assert summary["histogram"]["counts"] == [0, 2, 2, 1, 0, 0, 1, 0, 0, 1]
    assert summary["length"]["min"] == 2 and summary["length"]["max"] == 1001 and summary["length"]["median"] == 6
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


def test_max_tokens_cuts_the_corpus_and_its_index(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": "abcd"}) + "\n" for _ in range(5)))
    summary = prepare(str(tmp_path / "c.npy"), [str(corpus)], max_tokens=12)
    assert summary["tokens"] == 12 and summary["documents"] == 3
    assert np.load(index_paths(tmp_path / "c.npy")["npy"]).tolist() == [0, 5, 10]


def test_the_summary_says_max_tokens_stopped_it_and_how_many_sources_were_read(tmp_path):
    corpus = tmp_path / "files"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i:02d}.txt").write_text("abcd")
    result = run_cli("prepare", tmp_path / "c.npy", corpus, "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert "12 tokens in 3 documents from the first 3 of 20 sources (stopped at --max-tokens 12)" in result.stdout
    whole = run_cli("prepare", tmp_path / "whole.npy", corpus)
    assert "100 tokens in 20 documents from 20 sources (" in whole.stdout


def test_random_bytes_named_as_a_token_file_are_not_a_token_file(tmp_path):
    from jlong.data.corpus import TokenCorpus
    from jlong.errors import JlongError

    fake = tmp_path / "random.npy"
    fake.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(JlongError, match="is not a token file") as raised:
        TokenCorpus(str(fake))
    assert "pickle" not in str(raised.value) and "\n" not in str(raised.value)


def _bad_inputs(tmp_path):
    missing_field = tmp_path / "missing.jsonl"
    missing_field.write_text(json.dumps({"body": "x"}) + "\n")
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text('{"text": "fine"}\n{"text": \n')
    no_column = tmp_path / "nocolumn.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_column)
    not_parquet = tmp_path / "fake.parquet"
    not_parquet.write_text("not parquet")
    empty = tmp_path / "empty"
    empty.mkdir()
    return {
        "a missing field": ([missing_field], [], "line 1 has no field 'text'; name the text with --text-field"),
        "a line that is not JSON": ([not_json], [], "line 2 is not JSON"),
        "a missing column": ([no_column], [], "has no column 'text' (its columns: body)"),
        "an unreadable file": ([not_parquet], [], "as Parquet"),
        "an empty corpus": ([empty], [], "no files matching '*'"),
        "a tokenizer over the model's vocabulary": ([missing_field], ["--text-field", "body", "--vocab-size", "100"],
                                                   "the tokenizer's vocabulary (256) exceeds --vocab-size 100"),
        "shards named as a file": ([missing_field], ["--text-field", "body", "--shard-per-input"],
                                   "is a shard directory when sharding: give a directory"),
        "a shard size of zero": ([missing_field], ["--text-field", "body", "--shard-tokens", "0"],
                                 "--shard-tokens must be positive, got 0"),
        "no workers": ([missing_field], ["--text-field", "body", "--workers", "0"], "--workers must be at least 1"),
    }


def test_bad_input_is_one_line_and_leaves_nothing(tmp_path):
    for name, (inputs, options, message) in _bad_inputs(tmp_path).items():
        out = tmp_path / "out" / "tokens.npy"
        result = run_cli("prepare", out, *inputs, *options)
        assert_one_line_error(result, message)
        assert not (tmp_path / "out").exists(), f"{name}: the directory made for the output is left"


def test_batched_encoding_gives_the_ids_of_one_document_at_a_time(tmp_path, monkeypatch):
    """Batches small enough that the corpus spans many, each encoded while the next is read."""
    from jlong.data import prepare as preparing
    from jlong.data.encoder import Encoder

    monkeypatch.setattr(preparing, "BATCH_DOCUMENTS", 7)
    rng = np.random.default_rng(3)
    words = ["def", "return", "hello", "world", "é", "ü", "tokens", " ", "\n", "x" * 9, "0.5", "(", ")"]
    texts = ["".join(rng.choice(words, n)) for n in rng.integers(1, 60, 100)]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    _, directory = _tokenizer(tmp_path)
    for options in ({}, {"tokenizer_path": str(directory)}):
        encoder = Encoder.load(options.get("tokenizer_path"), None)
        one_at_a_time = [i for t in texts for i in [*encoder.encode(t), encoder.eos_id]]
        out = tmp_path / f"batched{len(options)}.npy"
        prepare(str(out), [str(corpus)], workers=2, **options)
        written = np.load(out)
        assert written.dtype == encoder.dtype and written.tolist() == one_at_a_time
        cut = prepare(str(tmp_path / f"cut{len(options)}.npy"), [str(corpus)], max_tokens=1000, **options)
        assert np.load(tmp_path / f"cut{len(options)}.npy").tolist() == one_at_a_time[:1000]
        assert cut["tokens"] == 1000


def test_prepare_never_writes_over_a_corpus(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "abcd"}) + "\n")
    out = tmp_path / "c.npy"
    prepare(str(out), [str(corpus)])
    before = out.read_bytes()
    result = run_cli("prepare", out, corpus)
    assert_one_line_error(result, f"output '{out}' exists: prepare never writes over a corpus")
    assert out.read_bytes() == before


def test_prepare_does_not_start_jax(tmp_path):
    import subprocess
    import sys

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "abcd"}) + "\n")
    probe = ("import sys; from jlong.cli import main; code = main(sys.argv[1:]); "
             "assert 'jax' not in sys.modules, 'prepare imported jax'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", probe, "prepare", str(tmp_path / "c.npy"), str(corpus)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
