"""Two small instruct tokenizers for the chat tests: a ChatML template in
Qwen's shape (a default system prompt, tool calls in <tool_call> tags, tool
results as user turns, <|im_end|> closing each turn) and a header template
in Llama 3's shape (a BOS, role headers, <|eot_id|> closing each turn).
Each marks its assistant text with `{% generation %}`, so transformers'
own assistant mask can be compared with jlong's, which does not read it."""

from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{%- if message.content %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls | default([]) %}"
    "{{- '\\n<tool_call>\\n' }}{{- {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}"
    "{{- '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HEADERS = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{%- generation %}"
    "{%- if message.tool_calls is defined %}"
    "{%- for call in message.tool_calls %}"
    "{{- {'name': call.function.name, 'parameters': call.function.arguments} | tojson }}"
    "{%- endfor %}"
    "{%- else %}{{- message.content | trim }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endgeneration %}"
    "{%- else %}"
    "{{- message.content | trim }}{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

TEMPLATES = {
    "chatml": {"template": CHATML, "special": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
               "added": ["<tool_call>", "</tool_call>"],
               "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}},
    "headers": {"template": HEADERS, "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                                 "<|end_header_id|>", "<|eot_id|>"], "added": [],
                "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}},
}

WORDS = ("the pass key is remember it what weather in paris today sunny and warm degrees answer question "
         "report document section code value lookup tool result café über naïve").split()

# A conversation with every kind of turn: a system prompt, a tool call (no content), a tool result, and two
# assistant turns with text.
EVERY_TURN = [
    {"role": "system", "content": "You answer from the document."},
    {"role": "user", "content": "A long report. The pass key is 73519. Remember it. More text follows. "
                                "What is the weather in Paris today, and what is the pass key?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny, 21 degrees"},
    {"role": "assistant", "content": "It is sunny and 21 degrees in Paris."},
    {"role": "user", "content": "And the pass key?"},
    {"role": "assistant", "content": "  The pass key is 73519.  "},
]


def chat_tokenizer(directory: Path, kind: str, *, vocab_size: int = 400) -> Path:
    """A byte-level BPE tokenizer with the template `kind`'s special tokens, saved with its
    tokenizer_config.json (and its chat template) in `directory`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    spec = TEMPLATES[kind]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=spec["special"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) for i in range(200)]
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in spec["added"]])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": spec["template"],
              "model_max_length": 1 << 20, **{k: v for k, v in spec["config"].items() if v is not None}}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def conversations(count: int, seed: int = 0, *, words: tuple[int, int] = (20, 120)) -> list[list[dict]]:
    """`count` random conversations: a short system prompt, a user turn of random words, an assistant
    answer, sometimes a second exchange."""
    import random

    rng = random.Random(seed)

    def text(low, high):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    made = []
    for _ in range(count):
        turns = [{"role": "system", "content": text(1, 3)}]
        for _ in range(rng.choice((1, 1, 2))):
            turns += [{"role": "user", "content": text(*words)}, {"role": "assistant", "content": text(2, 12)}]
        made.append(turns)
    return made
