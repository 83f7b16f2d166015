"""Conversations -> token ids and the mask of the ids to train on, with the
tokenizer's own chat template.

A conversation is a list of `{role, content}` turns (system, user,
assistant, tool; an assistant turn may carry `tool_calls` as transformers
represents them). It is rendered by the chat template of the tokenizer
directory (`chat_template.jinja`, which transformers 5 writes, or
`chat_template` in `tokenizer_config.json`) with jinja2 set up as
transformers sets it up (a sandboxed environment, trim_blocks and
lstrip_blocks, loop controls, its `tojson`, `raise_exception` and
`strftime_now`, the special tokens as variables, `None` fields dropped),
then tokenized whole without added special tokens, so the ids equal
`AutoTokenizer.apply_chat_template(messages, tokenize=True)`.

Which ids are trained (`train_on`):
- `assistant`: each assistant turn from the end of its header through the
  special token that closes it (`<|im_end|>`, `<|eot_id|>`, ...), tool
  calls included; the header is the template's generation prompt, found by
  rendering the turns before it with `add_generation_prompt`; the closing
  token is the last special token the template writes for that turn;
- `last`: the same for the last assistant turn only;
- `all`: every id, the end-of-document id too.
A token is trained when its first character lies in a trained span.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from jlong.data.encoder import Encoded, check_eos_id, load_tokenizer
from jlong.errors import JlongError

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "last", "all")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
END_OF_TEXT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|end|>")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers passes one under all three names
PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
         {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (templates that mark assistant text for transformers)
        renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment


class ChatTemplate:
    """A tokenizer directory's chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: dict[str, str], where: str):
        import jinja2

        self.where, self.special_tokens = where, special_tokens
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise JlongError(f"the chat template in {where} does not parse (line {err.lineno}: {err.message})") from None

    @classmethod
    def load(cls, directory: str | Path) -> ChatTemplate:
        path = Path(directory)
        if not path.is_dir():
            raise JlongError(f"--chat needs a tokenizer directory (with its chat template), not {str(path)!r}")
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))}
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return cls(jinja_file.read_text(encoding="utf-8"), special_tokens, str(jinja_file))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            named = {entry.get("name"): entry.get("template") for entry in source if isinstance(entry, dict)}
            source = named.get("default")
        if not isinstance(source, str) or not source:
            raise JlongError(f"the tokenizer directory {str(path)!r} has no chat template (chat_template.jinja, or "
                             "chat_template in tokenizer_config.json): use an instruct model's tokenizer")
        return cls(source, special_tokens, str(config_file))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as err:
            raise JlongError(f"the chat template ({self.where}) refused a conversation: {err}") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise JlongError(f"cannot read {str(path)!r} as JSON ({err})") from None


def _token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else None


def checked_messages(value, where: str) -> list[dict]:
    """A conversation as the template sees it: a list of turns with known roles, `None` fields dropped and
    reasoning under each name templates read (as transformers does)."""
    if not isinstance(value, list) or not value:
        raise JlongError(f"{where}: the messages must be a non-empty list of {{role, content}} turns, got "
                         f"{type(value).__name__ if not isinstance(value, list) else 'an empty list'}")
    turns = []
    for number, turn in enumerate(value):
        if not isinstance(turn, dict) or "role" not in turn:
            raise JlongError(f"{where}: turn {number} is not a {{role, content}} object")
        if turn["role"] not in ROLES:
            raise JlongError(f"{where}: turn {number} has the role {turn['role']!r}; the roles are {', '.join(ROLES)}")
        turn = {key: item for key, item in turn.items() if item is not None}
        reasoning = next((turn[key] for key in _REASONING_FIELDS if key in turn), None)
        if reasoning is not None:
            turn = {"thinking": reasoning, **turn, "reasoning_content": reasoning}
        turns.append(turn)
    return turns


class ChatEncoder:
    """Conversations -> ids, each conversation followed by the end-of-document id, and the trained ids."""

    masked, paired = True, False

    def __init__(self, tokenizer, template: ChatTemplate, train_on: str, eos_id: int | None):
        """`tokenizer`: a `tokenizers.Tokenizer`; `eos_id`: None for the default (`default_end_id`)."""
        if train_on not in TRAIN_ON:
            raise JlongError(f"--train-on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        self.tokenizer, self.template, self.train_on = tokenizer, template, train_on
        self.special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        self.eos_id = default_end_id(tokenizer, template) if eos_id is None else eos_id
        check_eos_id(self.eos_id, tokenizer)
        self.vocab_size = tokenizer.get_vocab_size()
        self.dtype = np.dtype(np.uint16 if self.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)

    @classmethod
    def load(cls, tokenizer_path: str | None, train_on: str, eos_id: int | None) -> ChatEncoder:
        if tokenizer_path is None:
            raise JlongError("--chat needs --tokenizer: the directory of the model's tokenizer, with its chat template")
        template = ChatTemplate.load(tokenizer_path)
        return cls(load_tokenizer(tokenizer_path), template, train_on, eos_id)

    def encode_batch(self, conversations: list[tuple[object, str]]) -> Encoded:
        """(messages, where read) -> the conversations' ids end to end with their trained ids; a
        conversation with nothing to train is left out and counted."""
        checked = [(checked_messages(value, where), where) for value, where in conversations]
        texts = [self.template.render(messages) for messages, _ in checked]
        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)  # on every core
        ids, trained, lengths = [], [], []
        for (messages, where), text, encoding in zip(checked, texts, encodings):
            one_ids, one_trained = self._with_mask(messages, text, encoding, where)
            if not one_trained.any():
                continue
            ids.append(one_ids)
            trained.append(one_trained)
            lengths.append(len(one_ids))
        if not ids:
            return Encoded(np.zeros(0, self.dtype), np.zeros(0, np.int64), np.zeros(0, bool), len(conversations))
        return Encoded(np.concatenate([np.asarray(i, self.dtype) for i in ids]), np.asarray(lengths, np.int64),
                       np.concatenate(trained), len(conversations) - len(ids))

    def encode(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray]:
        """(ids with the end id, [len(ids)] bool: trained) of one checked conversation."""
        text = self.template.render(messages)
        return self._with_mask(messages, text, self.tokenizer.encode(text, add_special_tokens=False), where)

    def _with_mask(self, messages: list[dict], text: str, encoding, where: str) -> tuple[list[int], np.ndarray]:
        ids = [*encoding.ids, self.eos_id]
        if self.eos_id in encoding.ids:
            raise JlongError(f"{where}: the conversation holds the end-of-document id {self.eos_id} "
                             f"({self.tokenizer.id_to_token(self.eos_id)!r}); choose another with --eos-id")
        if self.train_on == "all":
            return ids, np.ones(len(ids), bool)
        starts = np.array([start for start, _ in encoding.offsets] + [len(text)], np.int64)
        trained = np.zeros(len(ids), bool)
        for begin, end in self._trained_spans(messages, text, where):
            trained |= (starts >= begin) & (starts < end)
        trained[-1] = False  # the end id follows the conversation, outside every turn
        return ids, trained

    def _trained_spans(self, messages: list[dict], text: str, where: str) -> list[tuple[int, int]]:
        """[begin, end) character spans of the assistant turns to train, in `text` (the whole rendering)."""
        turns = [i for i, turn in enumerate(messages) if turn["role"] == "assistant"]
        spans = []
        for i in turns[-1:] if self.train_on == "last" else turns:
            before = self.template.render(messages[:i], add_generation_prompt=True)
            if not text.startswith(before):
                raise JlongError(f"{where}: the chat template renders the turns before assistant turn {i} "
                                 "differently once the conversation goes on, so the turn cannot be found; "
                                 "use --train-on all")
            alone = self.template.render(messages[: i + 1])
            closer = self._last_special(alone[len(before):] if alone.startswith(before) else "")
            if closer is None:
                raise JlongError(f"{where}: the chat template closes assistant turn {i} with no special token, so "
                                 "its end cannot be found; use --train-on all")
            end = text.find(closer, len(before))
            spans.append((len(before), end + len(closer) if end >= 0 else len(text)))
        return spans

    def _last_special(self, turn_text: str) -> str | None:
        """The special token that ends `turn_text` last, or None."""
        found = [(turn_text.rfind(token), token) for token in self.special if token in turn_text]
        return max(found, key=lambda f: (f[0], len(f[1])))[1] if found else None


def default_end_id(tokenizer, template: ChatTemplate) -> int:
    """The end-of-document id for chat data: the first of eos_token, pad_token and the usual end-of-text
    tokens that the template never writes inside a conversation (an instruct tokenizer's eos_token, such as
    Qwen's <|im_end|>, closes every turn)."""
    try:
        probe = template.render(PROBE)
    except JlongError:  # templates without a system role
        probe = template.render(PROBE[1:])
    written = set(tokenizer.encode(probe, add_special_tokens=False).ids)
    specials = sorted((i, t.content) for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
    names = [template.special_tokens.get("eos_token"), template.special_tokens.get("pad_token"),
             *(content for _, content in specials if content in END_OF_TEXT_NAMES)]
    for name in names:
        token_id = tokenizer.token_to_id(name) if name else None
        if token_id is not None and token_id not in written:
            return token_id
    raise JlongError("the tokenizer names no end-of-text token that its chat template leaves out of "
                     "conversations: give the end-of-document id with --eos-id")
