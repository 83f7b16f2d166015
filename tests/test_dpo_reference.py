"""DPO's reference log-probabilities with full fine-tuning: the cache beside
a preference file holds each pair's values under a key of contents (the
file's arrays, the weights' files), a run computes the pairs its rows hold
that the cache lacks, and concurrent writers leave one whole file.

A run at a longer train.seq_len after a shorter one starts at loss log 2
(the policy is its reference) and trains on finite losses: before, it read
NaN for the pairs that fit only its rows. (A file prepared again with
chosen and rejected swapped: tests/test_dpo.py.)"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, run_config, small_config

from jlong.data.corpus import TokenCorpus
from jlong.data.pairs import PreferencePairs
from jlong.data.reference_cache import Cached, ReferenceCache, cache_path

LONG_WORDS = (2, 160)  # 24 pairs of 35-312 tokens: 8 fit a row of 128 tokens, all 24 a row of 512


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from chat_fixtures import chat_tokenizer

    return chat_tokenizer(tmp_path_factory.mktemp("tokenizer") / "chatml", "chatml")


def _prepared(path, tokenizer, *, swapped=False):
    """`jlong prepare --preference` of 24 string pairs at `path` (chosen and rejected swapped if asked)."""
    from test_preference_data import _jsonl, string_pairs

    from jlong.data.prepare import prepare

    records = string_pairs(24, words=LONG_WORDS)
    if swapped:
        records = [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in records]
    prepare(str(path), [str(_jsonl(path.with_suffix(".jsonl"), records))], tokenizer_path=str(tokenizer),
            preference=True)
    return path


def _dpo_run(tmp_path, data, seq_len, *overrides):
    return run_config(tmp_path, "model.vocab_size=400", "train.objective=dpo", "data.source=tokens",
                      f"data.path={data}", "data.eos_id=null", "attention.max_documents=9", "train.steps=2",
                      "train.lr=1e-3", f"train.seq_len={seq_len}", "attention.block_size=64", *overrides)


def _computed(data) -> int:
    with np.load(cache_path(data)) as saved:
        return int(saved["computed"].sum())


def _starts_at_log_2_and_trains(records):
    """The policy is its reference at step 1 (its values read from the cache, which a program of another
    length may have computed: equal to float32 rounding); every loss finite (a NaN stops the run)."""
    assert abs(records[0]["loss"] - math.log(2)) < 1e-4 and abs(records[0]["rewards/margins"]) < 1e-4
    assert len(records) == 2 and all(math.isfinite(r["loss"]) for r in records)


def test_a_longer_run_after_a_shorter_one_computes_the_pairs_only_its_rows_hold(tmp_path, tokenizer):
    """So does `jlong eval` at the longer length: its held-out pairs are scored against finite references."""
    from jlong.data.recorded import with_recorded_data
    from jlong.eval.evaluate import evaluate
    from jlong.parallel.placement import make_mesh
    from jlong.training.loop import train

    data = _prepared(tmp_path / "pairs.npy", tokenizer)
    train(_dpo_run(tmp_path / "short", data, 128, "train.steps=1"))
    assert _computed(data) == 8
    # The run's config as its run_dir records it: the end id read from beside the pairs.
    longer = with_recorded_data(_dpo_run(tmp_path / "short", data, 512, f"eval.path={data}", "eval.sequences=2",
                                         "eval.passkey_trials=0"))
    scored = evaluate(longer, str(tmp_path / "short" / "ckpt"), make_mesh(longer.mesh))["preference"]
    assert scored["pairs"] > 2 and all(math.isfinite(value) for value in scored.values())
    assert 8 < _computed(data) < 24
    _starts_at_log_2_and_trains(train(_dpo_run(tmp_path / "long", data, 512)))
    assert _computed(data) == 24


@pytest.mark.slow  # the long tier: the suite runs its main case (a longer row after a shorter one) above
def test_a_run_in_stages_computes_each_stages_pairs_from_the_starting_weights(tmp_path, tokenizer):
    """Stage 2's rows hold pairs longer than stage 1's: their reference is computed before step 1, from
    the starting weights, by a program of stage 2's length."""
    from jlong.training.loop import train

    data = _prepared(tmp_path / "pairs.npy", tokenizer)
    stages = "stages=[{until_step: 1, set: {train.seq_len: 128}}, {until_step: 2, set: {train.seq_len: 512}}]"
    records = train(_dpo_run(tmp_path, data, 128, stages))
    assert [r["seq_len"] for r in records] == [128, 512] and all(math.isfinite(r["loss"]) for r in records)
    assert abs(records[0]["loss"] - math.log(2)) < 1e-4 and _computed(data) == 24


@pytest.mark.fast
def test_pairs_packed_for_the_reference_fill_the_first_pass_rows(tmp_path, tokenizer):
    """All the pairs that fit: the first pass's rows exactly; some of them: rows of only those, in its order."""
    source = PreferencePairs(TokenCorpus(str(_prepared(tmp_path / "pairs.npy", tokenizer))), seq_len=512,
                             batch_size=8, seed=3, eos_id=258, max_documents=9)
    rows = source.rows_of_pairs(source.kept)
    assert [r.tolist() for r in rows] == [source.pairs_of(i).tolist() for i in range(source.rows_per_epoch(0))]
    some = source.kept[::3]
    packed = np.concatenate(source.rows_of_pairs(some))
    first_pass = source.epoch(0)[0]
    assert packed.tolist() == [p for p in first_pass if p in some]
    assert all(source.lengths[r].sum() <= 513 and len(r) <= 4 for r in source.rows_of_pairs(some))
    np.testing.assert_array_equal(source.row_of(rows[0]), source.row(0))
    np.testing.assert_array_equal(source.slot_row_of(rows[0]), source.slot_row(0))


WRITER = """
import sys
import numpy as np
from jlong.data.reference_cache import Cached, ReferenceCache

cache, rng = ReferenceCache(sys.argv[1]), np.random.default_rng(int(sys.argv[2]))
values = np.arange(4000, dtype=np.float32).reshape(2000, 2)
for _ in range(60):
    computed = rng.random(2000) < 0.5
    cache.write({"data": "d", "weights": "w"}, Cached(np.where(computed[:, None], values, np.nan), computed))
"""


@pytest.mark.fast
def test_two_processes_writing_one_cache_leave_one_intact_file(tmp_path):
    """Each write is a whole file renamed over the cache: a reader during the writes and after them finds
    the values under their key, never a file cut short, and no temporary file is left."""
    key, values = {"data": "d", "weights": "w"}, np.arange(4000, dtype=np.float32).reshape(2000, 2)
    cache = ReferenceCache(tmp_path / "pairs.npy")
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "pairs.npy"), str(seed)], cwd=REPO,
                                stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    reads = 0
    while any(w.poll() is None for w in writers):
        cached, note = cache.read(key, 2000)
        assert note is None, note
        reads += cache.path.exists()
    assert [w.wait() for w in writers] == [0, 0], [w.stderr.read() for w in writers]
    cached, note = cache.read(key, 2000)
    assert note is None and reads > 0 and cached.computed.mean() > 0.5
    np.testing.assert_array_equal(cached.logps[cached.computed], values[cached.computed])
    assert np.isnan(cached.logps[~cached.computed]).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.reference-logps.npz"]


@pytest.mark.fast
def test_a_cache_of_another_key_or_cut_short_is_not_read(tmp_path):
    cache = ReferenceCache(tmp_path / "pairs.npy")
    computed = np.array([True, False, True])
    assert cache.write({"data": "d", "weights": "w"}, Cached(np.ones((3, 2), np.float32), computed)) is None
    cached, note = cache.read({"data": "d", "weights": "other"}, 3)
    assert not cached.computed.any() and note == (
        f"'{cache.path}' holds the reference log-probabilities of other weights: this run computes its own and "
        "replaces them")
    assert cache.read({"data": "d", "weights": "w"}, 4)[1].endswith("holds 3 pairs' reference log-probabilities, "
                                                                     "not 4: this run computes its own")
    cache.path.write_bytes(cache.path.read_bytes()[:40])
    cached, note = cache.read({"data": "d", "weights": "w"}, 3)
    assert not cached.computed.any() and "cannot be read" in note and "replaces it" in note
    assert oct(cache.path.stat().st_mode & 0o777) != "0o600"  # the umask's mode, as every other file


@pytest.mark.fast
def test_weights_digests_follow_the_weights_files(tmp_path):
    """A Hugging Face directory's digest changes with a byte of its safetensors, not with its tokenizer; a
    checkpoint step's, read from the file lists written with it, equals the digest of its files summed again."""
    from jlong.checkpoint import Checkpoints
    from jlong.checkpoint_integrity import FILE_LIST
    from jlong.digests import checkpoint_digest, hf_digest

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (hf / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    digest = hf_digest(hf)
    (hf / "tokenizer.json").write_text("{}")
    assert hf_digest(hf) == digest
    changed = bytearray((hf / "model.safetensors").read_bytes())
    changed[1000] ^= 1
    (hf / "model.safetensors").write_bytes(bytes(changed))
    assert hf_digest(hf) != digest

    model = small_config().model
    checkpoints = Checkpoints(tmp_path / "ckpt")
    checkpoints.save(1, {"w": np.arange(6, dtype=np.float32)}, {"m": np.zeros(2, np.float32)}, model=model)
    checkpoints.save(2, {"w": np.arange(6, dtype=np.float32) + 1}, {"m": np.zeros(2, np.float32)}, model=model)
    checkpoints.close()
    listed = [checkpoint_digest(tmp_path / "ckpt" / str(step)) for step in (1, 2)]
    assert listed[0] != listed[1]
    (tmp_path / "ckpt" / "2" / FILE_LIST).unlink()
    assert checkpoint_digest(tmp_path / "ckpt" / "2") == listed[1]
