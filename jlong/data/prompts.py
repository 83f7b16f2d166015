"""Prompts for generation and reinforcement learning, in TRL's prompt-only
format: one record per prompt (JSON Lines, Parquet or a `datasets`
directory) with

- `prompt_ids`: the prompt's token ids, or
- `prompt`: its text (tokenized as it is, without special tokens, as TRL
  tokenizes a prompt; bytes without a tokenizer), or a conversation (a list
  of {role, content} turns) rendered with the tokenizer's chat template and
  its generation prompt, as `jlong prepare --chat` renders conversations.

Every other field is kept beside the prompt (the output passes it through;
reward functions take it by name).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jlong.data.chat import ChatTemplate, checked_messages
from jlong.data.encoder import load_tokenizer
from jlong.data.readers import whole_records
from jlong.errors import JlongError

PROMPT_FIELDS = ("prompt", "prompt_ids")


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: list[int]
    given: Any  # the prompt as the record gave it: text, a conversation, or ids
    fields: dict  # the record's other fields


class PromptEncoder:
    """Text and conversations -> ids with a tokenizer directory (or bytes without one), and ids -> text."""

    def __init__(self, tokenizer: str | None, vocab_size: int):
        self.path, self.vocab_size = tokenizer, vocab_size
        self.tokenizer = load_tokenizer(tokenizer) if tokenizer else None
        self._template = None

    @property
    def template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.load(self.path)
        return self._template

    def encode(self, prompt, where: str) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenize(prompt, where)
        if self.tokenizer is None:
            raise JlongError(f"{where}: a conversation is rendered with a tokenizer's chat template: give the "
                             "model's tokenizer directory (--tokenizer, data.tokenizer)")
        text = self.template.render(checked_messages(prompt, where), add_generation_prompt=True)
        return self.tokenize(text, where)

    def tokenize(self, text: str, where: str) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.vocab_size < 256:
            raise JlongError(f"{where}: text without a tokenizer is read as bytes, which needs model.vocab_size >= "
                             f"256 ({self.vocab_size}): give a tokenizer, or prompt_ids")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str | None:
        """The text of generated ids, special tokens left out (as TRL decodes completions); None without a
        tokenizer."""
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)


def read_prompts(path: str | Path, encoder: PromptEncoder, setting: str = "--prompts") -> list[Prompt]:
    """Every prompt of the file or directory at `path`, checked: one line naming the first problem."""
    path = Path(path)
    if not path.exists():
        raise JlongError(f"{setting} {str(path)!r} does not exist")
    prompts = []
    for record, where in whole_records(path):
        given = [field for field in PROMPT_FIELDS if record.get(field) is not None]
        if len(given) != 1:
            raise JlongError(f"{where}: a prompt record has one of {' or '.join(PROMPT_FIELDS)}"
                             + (", not both" if given else ""))
        fields = {key: value for key, value in record.items() if key not in PROMPT_FIELDS}
        if given == ["prompt_ids"]:
            ids = _checked_ids(record["prompt_ids"], where)
            prompt = ids
        else:
            prompt = record["prompt"]
            if not isinstance(prompt, (str, list)):
                raise JlongError(f"{where}: prompt is {type(prompt).__name__}: give text or a conversation (a list "
                                 "of {role, content} turns)")
            ids = encoder.encode(prompt, where)
        if not ids:
            raise JlongError(f"{where}: the prompt has no tokens")
        if outside := [i for i in ids if not 0 <= i < encoder.vocab_size]:
            raise JlongError(f"{where}: token id {outside[0]} is outside the model's vocabulary (0 to "
                             f"{encoder.vocab_size - 1})")
        prompts.append(Prompt(ids, prompt, fields))
    if not prompts:
        raise JlongError(f"{setting} {str(path)!r} holds no prompts")
    return prompts


def _checked_ids(value, where: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise JlongError(f"{where}: prompt_ids must be a list of integers")
    return value
