"""`jlong prepare --preference` and `data.sampling: pairs`: TRL's DPO ids,
the completion mask, the pairs index, and rows of whole pairs with each
target's completion slot (`pair_documents`)."""

from __future__ import annotations

import json
import random
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from chat_fixtures import WORDS, chat_tokenizer
from helpers import SMALL_MODEL, assert_one_line_error, run_cli

from jlong.config import load_config
from jlong.data.corpus import TokenCorpus, mask_path, pairs_path
from jlong.data.pairs import PreferencePairs, describe
from jlong.data.prepare import prepare
from jlong.data.recorded import with_recorded_data
from jlong.data.sources import Batches, _check_pair_count
from jlong.errors import JlongError

pytestmark = pytest.mark.fast


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """chatml and headers (chat templates); plain: chatml's tokenizer with no template and <|endoftext|> as its
    eos_token (so the end id is the eos_token TRL appends); bos: headers with a post-processor adding a BOS to
    every text it tokenizes."""
    from tokenizers import Tokenizer, processors

    root = tmp_path_factory.mktemp("tokenizers")
    made = {kind: chat_tokenizer(root / kind, kind) for kind in ("chatml", "headers")}
    plain = root / "plain"
    plain.mkdir()
    shutil.copy(made["chatml"] / "tokenizer.json", plain)
    (plain / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                             "eos_token": "<|endoftext|>"}))
    made["plain"] = plain
    bos = root / "bos"
    bos.mkdir()
    tokenizer = Tokenizer.from_file(str(made["headers"] / "tokenizer.json"))
    first = ("<|begin_of_text|>", tokenizer.token_to_id("<|begin_of_text|>"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             pair="<|begin_of_text|> $A $B", special_tokens=[first])
    tokenizer.save(str(bos / "tokenizer.json"))
    shutil.copy(made["headers"] / "tokenizer_config.json", bos)
    made["bos"] = bos
    return made


def trl_ids(directory, records) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt_ids, chosen_ids, rejected_ids) of each record, from TRL's own DPO dataset preparation."""
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    prepared = DPOTrainer._prepare_dataset(SimpleNamespace(_tokenizer=tokenizer), datasets.Dataset.from_list(records),
                                           tokenizer, args, "train")
    return [(row["prompt_ids"], row["chosen_ids"], row["rejected_ids"]) for row in prepared]


def _text(rng, low, high):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def string_pairs(count, seed=0, words=(3, 20)):
    """Random prompts and completions; some prompts end mid-word so the completion's first token may merge
    with the prompt's last."""
    rng = random.Random(seed)
    records = []
    for number in range(count):
        prompt = _text(rng, *words) + ("" if number % 3 else " th")
        chosen, rejected = " " + _text(rng, 1, 8), ("e " if number % 3 == 0 else " ") + _text(rng, 1, 8)
        records.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return records


def conversation_pairs(count, seed=0, words=(3, 30)):
    """A system prompt and one or two exchanges before the completions (an assistant turn each)."""
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        prompt = [{"role": "system", "content": _text(rng, 1, 3)}, {"role": "user", "content": _text(rng, *words)}]
        if rng.random() < 0.4:
            prompt += [{"role": "assistant", "content": _text(rng, 2, 6)},
                       {"role": "user", "content": _text(rng, 2, 9)}]
        records.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": _text(rng, 1, 12)}],
                        "rejected": [{"role": "assistant", "content": _text(rng, 1, 12)}]})
    return records


def _jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _unpacked(path, count):
    return np.unpackbits(np.load(mask_path(path)))[:count].astype(bool)


def _expected(trl, eos):
    """The ids and mask prepare should write from TRL's ids: each pair's two documents, each closed by the end
    id unless it already ends with it; the completion ids alone trained."""
    ids, mask = [], []
    for prompt, *completions in trl:
        for completion in completions:
            document = [*prompt, *completion]
            closed = document[-1] == eos
            ids += document + ([] if closed else [eos])
            trained = [False] * len(prompt) + [True] * len(completion) + ([] if closed else [False])
            mask += [False] + trained[1:]  # an empty prompt's completion: its first id predicted by nothing
    return ids, mask


def _prepared_as_trl(tokenizer, tmp_path, records):
    """`prepare --preference` of `records`, checked id for id and mask bit for bit against TRL's
    preparation: (the summary, the ids written, TRL's (prompt, chosen, rejected) ids)."""
    out = tmp_path / "pairs.npy"
    summary = prepare(str(out), [str(_jsonl(tmp_path / "p.jsonl", records))], tokenizer_path=str(tokenizer),
                      preference=True)
    trl = trl_ids(tokenizer, records)
    want_ids, want_mask = _expected(trl, summary["eos_id"])
    written = np.load(out)
    assert written.tolist() == want_ids
    assert _unpacked(out, len(written)).tolist() == want_mask
    return summary, written, trl


@pytest.mark.parametrize("kind", ["chatml", "plain", "bos"])
def test_string_pairs_are_trls_ids_with_exactly_the_completions_masked(tokenizers, tmp_path, kind):
    records = string_pairs(12, seed=1)
    records[1]["chosen"] += {"chatml": "<|im_end|>", "plain": "<|endoftext|>", "bos": "<|eot_id|>"}[kind]
    records[2]["prompt"] = ""  # no prompt (a BOS alone with bos)
    summary, written, trl = _prepared_as_trl(tokenizers[kind], tmp_path, records)
    if kind == "bos":
        assert all(prompt[0] == written[0] for prompt, _, _ in trl)  # the post-processor's BOS on every prompt
    if kind == "plain":  # no template: the end id is the eos_token, which closes each completion
        assert all(chosen[-1] == summary["eos_id"] for _, chosen, _ in trl)
    # A merge across the boundary moved the split before the prompt's last token.
    assert any(len(prompt) < len(TokenizerIds(tokenizers[kind]).of(r["prompt"])) for r, (prompt, _, _)
               in zip(records, trl))
    assert summary["pairs"] == len(records) and summary["documents"] == 2 * len(records)
    assert summary["trained_tokens"] == int(_unpacked(tmp_path / "pairs.npy", len(written)).sum()) and summary["preference"]["format"] == "strings"
    starts = np.load(tmp_path / "pairs.documents.npy")
    assert np.array_equal(np.load(pairs_path(tmp_path / "pairs.npy")), starts.reshape(-1, 2))


class TokenizerIds:
    """The ids a tokenizer directory gives a text as transformers tokenizes it (special tokens added)."""

    def __init__(self, directory):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))

    def of(self, text):
        return self.tokenizer.encode(text).ids


@pytest.mark.parametrize("kind", ["chatml", "headers"])
def test_conversation_pairs_are_trls_ids_with_exactly_the_completions_masked(tokenizers, tmp_path, kind):
    records = conversation_pairs(10, seed=2)
    summary, written, trl = _prepared_as_trl(tokenizers[kind], tmp_path, records)
    assert summary["preference"]["format"] == "conversations"
    # The end id is the end-of-text token the template never writes (as --chat takes), not the turns' eos_token.
    assert TokenizerIds(tokenizers[kind]).tokenizer.id_to_token(summary["eos_id"]) == {
        "chatml": "<|endoftext|>", "headers": "<|end_of_text|>"}[kind]


def test_the_cli_counts_pairs_and_shards_and_max_tokens_keep_pairs_whole(tokenizers, tmp_path):
    source = _jsonl(tmp_path / "p.jsonl", conversation_pairs(30, seed=3))
    result = run_cli("prepare", tmp_path / "whole.npy", source, "--preference", "--tokenizer", tokenizers["chatml"])
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "whole.documents.json").read_text())
    assert f"wrote {tmp_path / 'whole.npy'}: 30 pairs (conversations) in 60 documents" in result.stdout
    assert f"{summary['trained_tokens']:,} trained (the completions)" in result.stdout
    sharded = prepare(str(tmp_path / "shards"), [str(source)], tokenizer_path=str(tokenizers["chatml"]),
                      preference=True, shard_tokens=700)
    assert len(sharded["shards"]) > 2
    whole, shards = TokenCorpus(str(tmp_path / "whole.npy")), TokenCorpus(str(tmp_path / "shards"))
    assert len(shards.files) == len(sharded["shards"])  # the pairs indices are not read as shards
    assert np.array_equal(shards.pair_starts(), whole.pair_starts())
    assert np.array_equal(shards[0 : len(shards)], whole[0 : len(whole)])
    starts = whole.pair_starts()[:, 0]
    cut = prepare(str(tmp_path / "cut.npy"), [str(source)], tokenizer_path=str(tokenizers["chatml"]),
                  preference=True, max_tokens=int(starts[7]) + 3)
    assert cut["pairs"] == 7 and cut["tokens"] == starts[7]


@pytest.mark.parametrize("case", ["missing rejected", "completion not assistant", "mixed record", "mixed file",
                                  "too long", "missing rejected column", "no tokenizer"])
def test_bad_preference_input_is_one_line_and_writes_nothing(tokenizers, tmp_path, case):
    good = conversation_pairs(4, seed=4)
    records, options, message = good, [], None
    if case == "missing rejected":
        records = [*good, {"prompt": "p", "chosen": " c"}]
        message = "line 5 has no field 'rejected'; a preference record holds prompt, chosen and rejected"
    elif case == "completion not assistant":
        records = [*good, {**good[0], "rejected": [{"role": "user", "content": "x"}]}]
        message = "line 5: rejected starts with a 'user' turn; a completion is the assistant's reply"
    elif case == "mixed record":
        records = [*good, {**good[0], "chosen": "just text"}]
        message = "line 5 mixes text and conversations (prompt a conversation, chosen text, rejected a conversation)"
    elif case == "mixed file":
        records = [*good, {"prompt": "p", "chosen": " c", "rejected": " r"}]
        message = "line 5 holds strings, but the records before it hold conversations"
    elif case == "too long":
        options = ["--max-len", "60"]
        message = "over --max-len 60"
    elif case == "no tokenizer":
        message = "--preference needs --tokenizer"
    source = _jsonl(tmp_path / "p.jsonl", records)
    if case == "missing rejected column":
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = tmp_path / "p.parquet"
        pq.write_table(pa.table({"prompt": ["a"], "chosen": ["b"]}), source)
        message = "has no column 'rejected' (its columns: prompt, chosen); a preference record holds"
    tokenizer = [] if case == "no tokenizer" else ["--tokenizer", tokenizers["chatml"]]
    out = tmp_path / "out" / "pairs.npy"
    assert_one_line_error(run_cli("prepare", out, source, "--preference", *tokenizer, *options), message)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module", params=["conversations", "strings"])
def packed_pairs(tokenizers, tmp_path_factory, request):
    """Short pairs (conversations: about 60-130 tokens; strings, whose documents the eos_token closes: 10-60)
    and four long ones (over 256): several pairs to a row of train.seq_len + 1 = 256, the long ones skipped."""
    root = tmp_path_factory.mktemp("pairs")
    make, tokenizer = ((conversation_pairs, "chatml") if request.param == "conversations"
                       else (string_pairs, "plain"))
    records = make(60, seed=5, words=(3, 12)) + make(4, seed=6, words=(150, 200))
    random.Random(7).shuffle(records)
    prepare(str(root / "pairs.npy"), [str(_jsonl(root / "p.jsonl", records))],
            tokenizer_path=str(tokenizers[tokenizer]), preference=True)
    return root


def _dpo_config(root, *overrides):
    return with_recorded_data(load_config(None, [*SMALL_MODEL, "model.vocab_size=512", "data.source=tokens",
                                                 f"data.path={root / 'pairs.npy'}", "train.objective=dpo",
                                                 "train.seq_len=255", "train.batch_size=4", *overrides]))


def _file_pairs(root):
    """Each pair of the file as (chosen document, rejected document, their masks)."""
    ids, starts = np.load(root / "pairs.npy"), np.load(root / "pairs.pairs.npy")
    mask = _unpacked(root / "pairs.npy", len(ids))
    bounds = [*starts.reshape(-1).tolist(), len(ids)]
    documents = [(ids[a:b].tolist(), mask[a:b]) for a, b in zip(bounds, bounds[1:])]
    return [(*documents[2 * p], *documents[2 * p + 1]) for p in range(len(starts))]


def test_rows_hold_whole_pairs_and_pair_documents_name_each_completion_target(packed_pairs):
    config = _dpo_config(packed_pairs)
    assert config.data.sampling == "pairs" and config.data.loss_mask and config.data.eos_id is not None
    eos, width = config.data.eos_id, config.train.seq_len + 1
    pairs = _file_pairs(packed_pairs)
    by_documents = {(tuple(c), tuple(r)): (cm, rm) for c, cm, r, rm in pairs}
    batches = Batches.from_config(config)
    assert set(batches.layout) == {"inputs", "targets", "segment_ids", "positions", "loss_mask", "pair_documents",
                                   "reference_logps"}  # full fine-tuning: the reference travels with the batch
    reference = np.arange(2 * len(pairs), dtype=np.float32).reshape(-1, 2)  # each pair's own two values
    batches.use_reference(reference)
    seen = 0
    for step in (1, 2, 3):
        batch = batches.batch(step)
        for b, held in enumerate(batches.source.pairs_of_step(step)):
            np.testing.assert_array_equal(batch["reference_logps"][b, :2 * len(held)], reference[held].reshape(-1))
            assert not batch["reference_logps"][b, 2 * len(held):].any()
        assert batch["pair_documents"].dtype == np.int32 and batch["loss_mask"].dtype == bool
        np.testing.assert_array_equal(batch["loss_mask"], batch["pair_documents"] >= 0)
        for b in range(config.train.batch_size):
            row = np.append(batch["inputs"][b], batch["targets"][b, -1]).tolist()
            want = np.full(width, -1)
            at, p = 0, 0
            while row[at:].count(eos) >= 2:  # whole pairs: two documents each
                chosen_end = row.index(eos, at) + 1
                rejected_end = row.index(eos, chosen_end) + 1
                key = (tuple(row[at:chosen_end]), tuple(row[chosen_end:rejected_end]))
                assert key in by_documents, "a row holds something other than a whole pair of the file"
                chosen_mask, rejected_mask = by_documents[key]
                want[at:chosen_end][chosen_mask] = 2 * p
                want[chosen_end:rejected_end][rejected_mask] = 2 * p + 1
                # The completion's first token is the target at the prompt's last position.
                first = at + int(np.argmax(chosen_mask))
                assert batch["pair_documents"][b, first - 1] == 2 * p and batch["pair_documents"][b, first - 2] == -1
                at, p = rejected_end, p + 1
            assert p >= 1 and set(row[at:]) <= {batches.source.pad_id}  # padding: one run, not the end id
            assert batch["segment_ids"][b, -1] + 1 == 2 * p + (at < width - 1)  # padding adds one document at most
            np.testing.assert_array_equal(batch["pair_documents"][b], want[1:])
            seen += p
    assert seen > 3 * config.train.batch_size  # several pairs to a row
    fresh = Batches.from_config(config)
    fresh.use_reference(reference)
    resumed = fresh.batch(3)  # a fresh reader gives step 3 exactly
    for key, value in batches.batch(3).items():
        np.testing.assert_array_equal(resumed[key], value)


def test_a_pass_takes_each_pair_that_fits_once_and_skips_and_counts_the_longer(packed_pairs):
    config = _dpo_config(packed_pairs)
    source = Batches.from_config(config).source
    lengths = [len(c) + len(r) for c, _, r, _ in _file_pairs(packed_pairs)]
    too_long = {p for p, length in enumerate(lengths) if length > 256}
    assert len(too_long) == 4 and source.skipped == 4
    assert "4 longer than a row of train.seq_len + 1 = 256 tokens are skipped" in describe(source, "pairs.npy")
    for number in (0, 1):
        first = sum(source.rows_per_epoch(n) for n in range(number))
        taken = [int(p) for i in range(first, first + source.rows_per_epoch(number)) for p in source.pairs_of(i)]
        assert sorted(taken) == sorted(set(range(len(lengths))) - too_long)
    assert source.pairs_of(0).tolist() != source.pairs_of(source.rows_per_epoch(0)).tolist()  # a new order


def test_a_row_holds_no_more_pairs_than_attention_max_documents_allows(packed_pairs):
    source = Batches.from_config(_dpo_config(packed_pairs, "attention.max_documents=5")).source
    assert source.most_pairs == 2
    assert max(len(source.pairs_of(i)) for i in range(20)) == 2
    corpus = TokenCorpus(str(packed_pairs / "pairs.npy"))
    with pytest.raises(JlongError, match="raise it to at least 3"):
        PreferencePairs(corpus, seq_len=255, batch_size=4, seed=0, eos_id=2, max_documents=2)
    with pytest.raises(JlongError, match=r"step 7's batch has a row of 6 completion slots \(3 preference pairs\), "
                                         r"over attention.max_documents \(5\)"):
        _check_pair_count(np.array([[-1, 0, 1, 5, -1]]), 5, 7)
