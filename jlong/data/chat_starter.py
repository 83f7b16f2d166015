"""A chat fine-tuning starter that needs nothing downloaded: a byte-level
tokenizer directory with ChatML's special tokens and chat template, and
synthetic multi-turn conversations for `configs/tiny-chat.yaml`.

The tokenizer (`write_tokenizer`; shipped as `configs/tokenizers/byte-chatml`):
ids 0-255 are the bytes (byte-level BPE without merges, as GPT-2 writes
bytes), then <|im_start|> 256, <|im_end|> 257 and <|endoftext|> 258, so a
model needs a vocabulary of at least 259. The template is ChatML, its
assistant text marked with `{% generation %}` (transformers' assistant
mask); <|im_end|> closes every turn and is the eos_token, <|endoftext|> (the
pad token, never written by the template) ends each conversation in a
prepared file.

The conversations (`write_conversations`), 400-1,800 tokens each (bytes, plus
a few per turn): a system prompt, a first user turn of notes (filler
sentences with the user's name and a one-digit code among them) and its
acknowledgement, then two to five exchanges, each a user turn (a few
sentences or none, and a question) and the assistant's answer: a sum of two
digits, counting between two numbers, or recalling the name or the code from
the notes. The answers follow fixed templates from what the question states,
so a 2-layer byte model's loss on them falls in a few hundred steps: in
configs/tiny-chat.yaml's 200 steps from 5.6 to about 0.3, the templates'
wording learned (0.66-0.94 of the answers' tokens predicted, the
acknowledgement whole) but not yet the digits and names the question or the
notes give, which take far longer (recalling from the notes, hundreds of
bytes back, longest).

    python -m jlong.data.chat_starter OUT_DIR [--conversations 2000] [--held-out 100] [--seed 0] [--tokenizer DIR]

writes OUT_DIR/chats.jsonl and OUT_DIR/held-out.jsonl (`{"messages": [...]}` a line), and with
--tokenizer the tokenizer directory (configs/tokenizers/byte-chatml is the same).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")  # ids 256, 257, 258
BYTES = 256

CHAT_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {{- (message.content or '') + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": None,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "clean_up_tokenization_spaces": False,
    "model_max_length": 1_000_000,
}


def byte_characters() -> list[str]:
    """The character byte-level BPE writes for each byte 0-255 (GPT-2's bytes_to_unicode): printable
    Latin-1 bytes as themselves, the others as 256, 257, ... in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    characters, shifted = [], BYTES
    for byte in range(BYTES):
        if byte in printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(shifted))
            shifted += 1
    return characters


def tokenizer_json() -> dict:
    """tokenizer.json (the `tokenizers` format 1.0) of the byte-level tokenizer, written out field by field
    so the shipped file does not change with the library's version."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [{"id": BYTES + i, "content": token, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}
                         for i, token in enumerate(SPECIAL_TOKENS)],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {character: byte for byte, character in enumerate(byte_characters())}, "merges": []},
    }


def write_tokenizer(directory: str | Path) -> Path:
    """Writes the byte-level ChatML tokenizer directory (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) and checks that the `tokenizers` library reads it as bytes plus the special tokens."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = json.dumps(tokenizer_json(), indent=1, ensure_ascii=False) + "\n"
    _check(text)
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=1) + "\n", encoding="utf-8")
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    return directory


def _check(text: str) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(text)
    sample = "<|im_start|>user\ncafé 7 + 2?<|im_end|>\n<|endoftext|>"
    want = [256, *b"user\ncaf\xc3\xa9 7 + 2?", 257, *b"\n", 258]
    got = tokenizer.encode(sample, add_special_tokens=False).ids
    if got != want or tokenizer.get_vocab_size() != BYTES + len(SPECIAL_TOKENS):
        raise AssertionError(f"the byte-level tokenizer encodes {sample!r} as {got}, not {want}")


# The conversations -----------------------------------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
NOTES = "Here are my notes. "
ACKNOWLEDGED = "Thank you, I have read your notes."
NAMES = ("Ada", "Ben", "Cleo", "Dev", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jun")
SENTENCES = (
    "The river runs past the old mill.", "We met at the station at noon.", "The garden needs water again.",
    "My sister sent a letter from the coast.", "The train was late by ten minutes.",
    "There is bread on the kitchen table.", "The cat sleeps in the sun all day.",
    "Our neighbours painted their door red.", "The library closes early on Fridays.",
    "It rained for most of the morning.", "The bridge over the canal is closed.",
    "I bought apples and pears at the market.", "The meeting moved to the small room.",
    "A storm is coming in from the west.", "The old clock in the hall runs slow.",
    "We walked along the shore after lunch.", "The printer on the second floor is broken.",
    "Tea tastes better with a little honey.", "The lights in the park come on at dusk.",
    "The bus stops outside the bakery.",
)


def _filler(rng: random.Random, length: int) -> list[str]:
    sentences: list[str] = []
    while sum(len(s) + 1 for s in sentences) < length:
        sentences.append(rng.choice(SENTENCES))
    return sentences


def _exchange(rng: random.Random, name: str, code: int) -> tuple[str, str]:
    """(question, answer) of one kind drawn at random."""
    kind = rng.choice(("add", "count", "name", "code"))
    if kind == "add":
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == "count":
        start = rng.randint(1, 12)
        end = start + rng.randint(2, 7)
        return f"Count from {start} to {end}.", ", ".join(str(n) for n in range(start, end + 1)) + "."
    if kind == "name":
        return "What is my name?", f"Your name is {name}."
    return "What is the code?", f"The code is {code}."


def conversation(rng: random.Random, length: int) -> list[dict]:
    """One conversation of about `length` tokens (or as many as its exchanges and 100 bytes of notes take,
    when more): the system prompt, the user's notes (filler sentences that state the user's name and a
    one-digit code) and their acknowledgement, then two to five exchanges."""
    name, code = rng.choice(NAMES), rng.randint(0, 9)
    exchanges = []
    for _ in range(rng.randint(2, 5)):
        question, answer = _exchange(rng, name, code)
        chatter = " ".join(_filler(rng, rng.randint(0, 120))) if rng.random() < 0.5 else ""
        exchanges += [{"role": "user", "content": f"{chatter} {question}".strip()},
                      {"role": "assistant", "content": answer}]
    facts = [f"My name is {name}.", f"The code is {code}."]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": NOTES},
                {"role": "assistant", "content": ACKNOWLEDGED}, *exchanges]
    room = length - _tokens(messages) - sum(len(fact) + 1 for fact in facts)
    sentences = _filler(rng, max(room, 100))
    for fact in facts:
        sentences.insert(rng.randint(0, len(sentences)), fact)
    messages[1] = {"role": "user", "content": NOTES + " ".join(sentences)}
    return messages


def _tokens(messages: list[dict]) -> int:
    """The conversation's length in the byte-level ChatML tokenizer's ids, without the end id."""
    return sum(len(turn["content"].encode()) + len(turn["role"]) + 4 for turn in messages)


def write_conversations(path: str | Path, count: int, seed: int = 0,
                        lengths: tuple[int, int] = (400, 1800)) -> Path:
    """`count` conversations as JSON Lines (`{"messages": [...]}`), the same for the same seed, each of about
    a length drawn from `lengths` (tokens, both ends included)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(count):
            f.write(json.dumps({"messages": conversation(rng, rng.randint(*lengths))}) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jlong.data.chat_starter",
                                     description="Writes synthetic conversations for configs/tiny-chat.yaml.")
    parser.add_argument("out_dir", help="writes OUT_DIR/chats.jsonl and OUT_DIR/held-out.jsonl")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--held-out", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0, help="the held-out conversations use seed + 1")
    parser.add_argument("--tokenizer", metavar="DIR", help="also write the tokenizer directory here")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    for path, count, seed in ((out / "chats.jsonl", args.conversations, args.seed),
                              (out / "held-out.jsonl", args.held_out, args.seed + 1)):
        if path.exists():  # never over a file that may be someone's own data; the same seed writes the same
            print(f"kept {path} (it exists; remove it to write {count:,} conversations anew)")
            continue
        write_conversations(path, count, seed)
        print(f"wrote {count:,} conversations to {path}")
    if args.tokenizer:
        print(f"wrote the byte-level ChatML tokenizer to {write_tokenizer(args.tokenizer)}")


if __name__ == "__main__":
    sys.exit(main())
