"""Preference pairs -> token ids, the completion mask and the pairs, with
the ids TRL's DPO trainer makes (`jlong prepare --preference`).

A record holds `prompt`, `chosen` and `rejected`, TRL's explicit-prompt
preference format: three strings, or three conversations (lists of
{role, content} turns; each completion starts with an assistant turn).
Its ids are those of TRL's `DPOTrainer` dataset preparation:
- strings: a completion not already ending with the tokenizer's
  `eos_token` (tokenizer_config.json) gets it appended as text; the prompt,
  prompt + chosen and prompt + rejected are each tokenized as the tokenizer
  tokenizes a text (its special tokens added, a BOS where its
  post-processor adds one);
- conversations: the prompt's turns rendered with the chat template and
  the generation prompt, then the prompt's turns followed by the chosen
  turns, and by the rejected turns, each rendered without it (as
  `jlong.data.chat` renders, the same as transformers) and tokenized
  without added special tokens.
The completion begins where the prompt's ids stop being a prefix of both
prompt + chosen and prompt + rejected (TRL's `common_prefix_length`, which
the prompt alone usually is); its ids (TRL's `chosen_ids` and
`rejected_ids`) are the trained ones, but for a document's first id (an
empty prompt's), which no position predicts, in TRL's loss as here.

Each pair becomes two documents, prompt + chosen then prompt + rejected,
each followed by the end-of-document id unless its ids already end with it
(a string completion's appended `eos_token`, when that is the end id). The
end id: --eos-id, else what `--chat` takes when the tokenizer directory has
a chat template (an end-of-text token the template never writes), else the
`eos_token`. It may appear nowhere else in a pair: such a pair is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jlong.data.chat import ChatTemplate, _read_json, _token_text, checked_messages, default_end_id
from jlong.data.encoder import Encoded, check_eos_id, load_tokenizer
from jlong.errors import JlongError

FIELDS = ("prompt", "chosen", "rejected")
FIELD_HINT = "a preference record holds prompt, chosen and rejected (TRL's explicit-prompt format)"
STRINGS, CONVERSATIONS = "strings", "conversations"


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading ids the two share."""
    for position, (a, b) in enumerate(zip(ids, other)):
        if a != b:
            return position
    return min(len(ids), len(other))


class PreferenceEncoder:
    """Preference records -> two documents each (prompt + chosen, prompt + rejected), their trained
    (completion) ids, in `Encoded` batches whose lengths come two to a pair."""

    masked, paired = True, True

    def __init__(self, tokenizer, template: ChatTemplate | None, eos_token: str | None, eos_id: int | None,
                 max_len: int | None, where: str):
        """`tokenizer`: a `tokenizers.Tokenizer`; `template`: the directory's chat template (None: it has
        none); `eos_token`: the text string completions end with (None: the tokenizer names none)."""
        if max_len is not None and max_len < 2:
            raise JlongError(f"--max-len must be at least 2 (a pair is two documents), got {max_len}")
        self.tokenizer, self.template, self.eos_token, self.max_len, self.where = (
            tokenizer, template, eos_token, max_len, where)
        if eos_id is None:
            if template is not None:
                eos_id = default_end_id(tokenizer, template)
            elif eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
                eos_id = tokenizer.token_to_id(eos_token)
            else:
                raise JlongError("give the end-of-document id with --eos-id (the tokenizer names no eos_token "
                                 "and has no chat template)")
        self.eos_id = eos_id
        check_eos_id(eos_id, tokenizer)
        self.vocab_size = tokenizer.get_vocab_size()
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)
        self.kind = None  # strings or conversations: the first record's, which every record must share

    @classmethod
    def load(cls, tokenizer_path: str | None, eos_id: int | None, max_len: int | None) -> PreferenceEncoder:
        if tokenizer_path is None:
            raise JlongError("--preference needs --tokenizer: the directory of the model's tokenizer (its "
                             "eos_token, and its chat template for conversations)")
        path = Path(tokenizer_path)
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if path.is_dir() and config_file.is_file() else {}
        template = None
        if path.is_dir() and ((path / "chat_template.jinja").is_file() or config.get("chat_template")):
            template = ChatTemplate.load(path)
        return cls(load_tokenizer(tokenizer_path), template, _token_text(config.get("eos_token")), eos_id, max_len,
                   str(path))

    def encode_batch(self, records: list[tuple[tuple, str]]) -> Encoded:
        """((prompt, chosen, rejected), where read) -> the pairs' documents end to end, two lengths a pair."""
        kind = None
        for values, where in records:
            kind = self._kind(values, where)
        if kind == STRINGS:
            texts = [text for values, where in records for text in self._string_texts(values, where)]
        else:
            texts = [text for values, where in records for text in self._conversation_texts(values, where)]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=kind == STRINGS)  # on every core
        ids, trained = [], []
        for number, (_, where) in enumerate(records):
            prompt, chosen, rejected = (encodings[3 * number + k].ids for k in range(3))
            for document, mask in self.documents(prompt, chosen, rejected, where):
                ids.append(np.asarray(document, self.dtype))
                trained.append(mask)
        return Encoded(np.concatenate(ids), np.fromiter(map(len, ids), np.int64, len(ids)), np.concatenate(trained))

    def documents(self, prompt: list[int], prompt_chosen: list[int], prompt_rejected: list[int],
                  where: str) -> list[tuple[list[int], np.ndarray]]:
        """The pair's two documents (ids with the end id) and their trained ids: TRL's completion ids."""
        start = min(common_prefix_length(prompt, prompt_chosen), common_prefix_length(prompt, prompt_rejected))
        out = []
        for name, ids in (("chosen", prompt_chosen), ("rejected", prompt_rejected)):
            closed = bool(ids) and ids[-1] == self.eos_id  # the completion's eos_token ends the document
            if self.eos_id in (ids[:-1] if closed else ids):
                raise JlongError(f"{where}: prompt + {name} holds the end-of-document id {self.eos_id} "
                                 f"({self.tokenizer.id_to_token(self.eos_id)!r}) before its end; choose another "
                                 "with --eos-id")
            trained = np.zeros(len(ids) + (not closed), bool)
            trained[max(start, 1) : len(ids)] = True  # a document's first id is no target (nor in TRL's loss)
            out.append((list(ids) if closed else [*ids, self.eos_id], trained))
        total = len(out[0][0]) + len(out[1][0])
        if self.max_len is not None and total > self.max_len:
            raise JlongError(f"{where}: the pair is {total:,} tokens (prompt + chosen and prompt + rejected, each "
                             f"with its end id), over --max-len {self.max_len:,}; leave it out, or train at a "
                             "longer train.seq_len")
        return out

    def _kind(self, values: tuple, where: str) -> str:
        """strings or conversations: one kind in a record, and the first record's kind in all."""
        for field, value in zip(FIELDS, values):
            if value is None:
                raise JlongError(f"{where} has no {field!r}; {FIELD_HINT}")
            if not isinstance(value, (str, list)):
                raise JlongError(f"{where}: {field!r} is {type(value).__name__}: give text, or a conversation (a "
                                 "list of {role, content} turns)")
        kinds = [STRINGS if isinstance(value, str) else CONVERSATIONS for value in values]
        if len(set(kinds)) > 1:
            shown = ", ".join(f"{field} {'text' if kind == STRINGS else 'a conversation'}"
                              for field, kind in zip(FIELDS, kinds))
            raise JlongError(f"{where} mixes text and conversations ({shown}): a record's prompt, chosen and "
                             "rejected are all text or all conversations")
        if self.kind is not None and kinds[0] != self.kind:
            raise JlongError(f"{where} holds {kinds[0]}, but the records before it hold {self.kind}: one "
                             "preference corpus is one kind (TRL decides how to tokenize from the first record)")
        self.kind = kinds[0]
        return self.kind

    def _string_texts(self, values: tuple[str, str, str], where: str) -> list[str]:
        """The prompt, prompt + chosen and prompt + rejected, each completion ending with the eos_token."""
        if self.eos_token is None:
            raise JlongError(f"{where}: string completions end with the tokenizer's eos_token, which TRL appends, "
                             f"but {self.where!r} names none (tokenizer_config.json's eos_token)")
        prompt, chosen, rejected = values
        return [prompt, *(prompt + (c if c.endswith(self.eos_token) else c + self.eos_token)
                          for c in (chosen, rejected))]

    def _conversation_texts(self, values: tuple[list, list, list], where: str) -> list[str]:
        """The prompt rendered with the generation prompt, then prompt + chosen and prompt + rejected."""
        if self.template is None:
            raise JlongError(f"{where} holds conversations, but the tokenizer {self.where!r} has no chat template "
                             "(chat_template.jinja, or chat_template in tokenizer_config.json): use an instruct "
                             "model's tokenizer directory")
        prompt, chosen, rejected = (checked_messages(value, f"{where}: {field}")
                                    for field, value in zip(FIELDS, values))
        for field, turns in (("chosen", chosen), ("rejected", rejected)):
            if turns[0]["role"] != "assistant":
                raise JlongError(f"{where}: {field} starts with a {turns[0]['role']!r} turn; a completion is the "
                                 "assistant's reply, from an assistant turn")
        render = self.template.render
        return [render(prompt, add_generation_prompt=True), render(prompt + chosen), render(prompt + rejected)]

    def summary(self) -> dict:
        """How the pairs were made, for NAME.documents.json."""
        made = {"format": self.kind, "tokenized_as": "trl.DPOTrainer"}
        if self.kind == CONVERSATIONS:
            made["template"] = Path(self.template.where).name
        elif self.kind == STRINGS:
            made["eos_token_appended"] = self.eos_token
        return made
