"""The chat starter: the shipped byte-level ChatML tokenizer directory is
what `jlong.data.chat_starter.write_tokenizer` writes, configs/tiny-chat.yaml's
vocabulary holds its special tokens, its template goes through `jlong prepare
--chat` (and transformers) with the special ids and mask expected, and the
README's commands train the tiny model on the starter's conversations with a
falling loss."""

import json

import numpy as np
import pytest
from helpers import REPO

import jlong
from jlong.config import load_config
from jlong.data import chat_starter
from jlong.data.chat import checked_messages
from jlong.data.corpus import mask_path
from jlong.data.prepare import prepare

SHIPPED = REPO / "configs" / "tokenizers" / "byte-chatml"
CONFIG = REPO / "configs" / "tiny-chat.yaml"
IM_START, IM_END, END_OF_TEXT = 256, 257, 258
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 plus 3? café"},
        {"role": "assistant", "content": "2 plus 3 is 5."}, {"role": "user", "content": "Count from 1 to 3."},
        {"role": "assistant", "content": "1, 2, 3."}]


def _conversation_ids(chat) -> tuple[list[int], list[bool]]:
    """The ids and mask expected for `chat`: ChatML over bytes, each assistant turn's text and its
    <|im_end|> trained, <|endoftext|> after the conversation."""
    ids, trained = [], []
    for turn in chat:
        header = [IM_START, *f"{turn['role']}\n".encode()]
        body = [*turn["content"].encode(), IM_END]
        ids += header + body + [ord("\n")]
        trained += [False] * len(header) + [turn["role"] == "assistant"] * len(body) + [False]
    return ids + [END_OF_TEXT], trained + [False]


@pytest.mark.fast
def test_the_shipped_tokenizer_directory_is_what_the_code_writes(tmp_path):
    written = chat_starter.write_tokenizer(tmp_path / "tokenizer")
    names = sorted(p.name for p in SHIPPED.iterdir())
    assert names == sorted(p.name for p in written.iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (SHIPPED / name).read_bytes() == (written / name).read_bytes(), (
            f"configs/tokenizers/byte-chatml/{name} differs from what jlong.data.chat_starter.write_tokenizer writes: "
            "run `python -c \"from jlong.data.chat_starter import write_tokenizer; "
            "write_tokenizer('configs/tokenizers/byte-chatml')\"`")
    assert sum((SHIPPED / name).stat().st_size for name in names) < 8_000


@pytest.mark.fast
def test_the_tokenizer_is_the_bytes_and_chatmls_special_tokens():
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    every_byte = bytes(range(256))
    text = every_byte.decode("latin-1")  # each byte below 128 as itself; the rest as two UTF-8 bytes
    assert tokenizer.encode(text, add_special_tokens=False).ids == list(text.encode())
    assert [tokenizer.token_to_id(t) for t in chat_starter.SPECIAL_TOKENS] == [IM_START, IM_END, END_OF_TEXT]
    sample = "<|im_start|>user\nnaïve ☃<|im_end|>"
    ids = tokenizer.encode(sample, add_special_tokens=False).ids
    assert ids == [IM_START, *"user\nnaïve ☃".encode(), IM_END]
    assert tokenizer.decode(ids, skip_special_tokens=False) == sample


@pytest.mark.fast
def test_the_configs_vocabulary_holds_every_special_token():
    from tokenizers import Tokenizer

    config = load_config(CONFIG)
    tokenizer = Tokenizer.from_file(str(SHIPPED / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 259
    assert max(tokenizer.token_to_id(t) for t in chat_starter.SPECIAL_TOKENS) < config.model.vocab_size
    assert config.model.vocab_size % config.mesh.size == 0
    assert config.data.sampling == "documents" and config.eval.path and config.train.seq_len >= 2000


@pytest.mark.fast
def test_the_template_prepares_conversations_with_the_special_ids_and_the_assistant_mask(tmp_path):
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps({"messages": CHAT}) + "\n")
    summary = prepare(str(tmp_path / "chats.npy"), [str(source)], tokenizer_path=str(SHIPPED), chat=True)
    assert summary["eos_id"] == END_OF_TEXT and summary["vocab_size"] == 259
    ids = np.load(tmp_path / "chats.npy")
    mask = np.unpackbits(np.load(mask_path(tmp_path / "chats.npy")))[: len(ids)].astype(bool)
    want_ids, want_mask = _conversation_ids(CHAT)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask


@pytest.mark.fast
def test_transformers_reads_the_directory_with_the_same_ids_and_assistant_mask():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED))
    out = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    want_ids, want_mask = _conversation_ids(CHAT)
    assert list(out["input_ids"]) == want_ids[:-1]  # jlong adds the end of the document
    assert list(map(bool, out["assistant_masks"])) == want_mask[:-1]
    assert tokenizer.eos_token_id == IM_END and tokenizer.pad_token_id == END_OF_TEXT
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.fast
def test_conversations_are_deterministic_long_and_answer_from_what_the_user_said(tmp_path):
    first = chat_starter.write_conversations(tmp_path / "a.jsonl", 200, seed=3).read_text()
    assert first == chat_starter.write_conversations(tmp_path / "b.jsonl", 200, seed=3).read_text()
    assert first != chat_starter.write_conversations(tmp_path / "c.jsonl", 200, seed=4).read_text()
    chats = [json.loads(line)["messages"] for line in first.splitlines()]
    sizes = [chat_starter._tokens(chat) for chat in chats]  # ids, as the test above counts them
    assert 400 <= min(sizes) and max(sizes) < 1_880 and 900 < np.median(sizes) < 1_300
    for chat in chats:
        checked_messages(chat, "starter")
        notes = chat[1]["content"]
        assert [t["role"] for t in chat[:3]] == ["system", "user", "assistant"]
        for question, answer in zip(chat[3::2], chat[4::2]):
            assert question["role"] == "user" and answer["role"] == "assistant"
            q, a = question["content"], answer["content"]
            if q.endswith("What is my name?"):
                assert f"My name is {a.removeprefix('Your name is ').rstrip('.')}." in notes
            elif q.endswith("What is the code?"):
                assert f"{a.rstrip('.')}." in notes
            elif " plus " in q:
                x, y = map(int, q.split("What is ")[1].rstrip("?").split(" plus "))
                assert a == f"{x} plus {y} is {x + y}."
            else:
                start, end = map(int, q.split("Count from ")[1].rstrip(".").split(" to "))
                assert a == ", ".join(map(str, range(start, end + 1))) + "."


@pytest.mark.fast
def test_the_module_writes_training_and_held_out_conversations(tmp_path, capsys):
    chat_starter.main([str(tmp_path / "data"), "--conversations", "5", "--held-out", "2",
                       "--tokenizer", str(tmp_path / "tokenizer")])
    train = (tmp_path / "data" / "chats.jsonl").read_text().splitlines()
    held = (tmp_path / "data" / "held-out.jsonl").read_text().splitlines()
    assert len(train) == 5 and len(held) == 2 and not set(train) & set(held)
    assert "wrote 5 conversations" in capsys.readouterr().out
    assert (tmp_path / "tokenizer" / "tokenizer.json").read_bytes() == (SHIPPED / "tokenizer.json").read_bytes()
    (tmp_path / "data" / "chats.jsonl").write_text("mine\n")  # a file already there is kept, and said so
    chat_starter.main([str(tmp_path / "data"), "--conversations", "5", "--held-out", "2"])
    assert (tmp_path / "data" / "chats.jsonl").read_text() == "mine\n"
    assert "kept " in capsys.readouterr().out


def test_the_readmes_commands_fine_tune_the_tiny_model_with_a_falling_loss(tmp_path):
    """The commands of configs/tiny-chat.yaml's header on fewer, shorter conversations and steps: the
    conversations, `jlong prepare --chat` with the shipped tokenizer, and the config trained."""
    data = tmp_path / "chat-data"
    for name, count, seed in (("chats", 60, 0), ("held-out", 4, 1)):  # short: every sequence of 512 holds answers
        chat_starter.write_conversations(data / f"{name}.jsonl", count, seed, lengths=(300, 500))
    for name in ("chats", "held-out"):
        prepare(str(data / f"{name}.npy"), [str(data / f"{name}.jsonl")], tokenizer_path=str(SHIPPED), chat=True)
    records = jlong.train(CONFIG, [
        f"data.path={data / 'chats.npy'}", f"eval.path={data / 'held-out.npy'}", f"run_dir={tmp_path / 'run'}",
        f"checkpoint.dir={tmp_path / 'run' / 'checkpoints'}", "train.steps=30", "train.seq_len=512",
        "train.batch_size=2", "train.warmup_steps=5", "train.eval_every=30", "eval.sequences=2",
        "checkpoint.every=0"])
    losses = [r["loss"] for r in records]
    assert len(losses) == 30 and all(r["trained_tokens"] > 0 for r in records)
    assert losses[0] > 5.0  # about ln(264) from the start
    assert np.mean(losses[-5:]) < 0.5 * losses[0]  # about 5.6 -> 1.5 on this data
    assert records[-1]["eval_loss"] < losses[0]
