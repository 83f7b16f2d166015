"""Evaluation by generated answers (RULER-style tasks whose answers are
words or several values, where one forward pass cannot read them off):
each prompt of `eval.answers_path` is completed greedily by the sampler
(`jlong.generation`) on the run's mesh, up to `eval.answers_max_new_tokens`
tokens or a stop id (`eval.stop_ids` and the checkpoint's end-of-sequence
ids), and its text is scored against the record's `answer`:

- a string: 1 when the text equals it, spaces around either aside (exact match);
- a list of values: the share of them the text holds (a task that asks for
  several, each found anywhere in the answer).

The accuracy is the mean score, whole and by the prompts' lengths (powers of
two of tokens), with the first few answers for reading.
"""

from __future__ import annotations

import dataclasses
import math

from jlong.config import Config
from jlong.data.prompts import Prompt, PromptEncoder, read_prompts
from jlong.errors import JlongError
from jlong.generation.sampler import Completion, Request, Sampler
from jlong.generation.sampling import SamplingSettings

SETTING = "eval.answers_path"
SHOWN = 4  # answers kept in the report for reading


@dataclasses.dataclass(frozen=True)
class AnswerTrial:
    prompt: Prompt
    answer: str | tuple[str, ...]  # the one answer, or the values it must hold


def answer_trials(config: Config) -> tuple[list[AnswerTrial], PromptEncoder]:
    """The prompts of eval.answers_path with their answers, checked (one line for the first problem)."""
    encoder = PromptEncoder(config.eval.tokenizer, config.model.vocab_size)
    if encoder.tokenizer is None and config.model.vocab_size < 256:
        raise JlongError(f"{SETTING}: answers are read as text: set eval.tokenizer (the model's tokenizer directory)")
    trials = []
    for number, prompt in enumerate(read_prompts(config.eval.answers_path, encoder, SETTING)):
        answer = prompt.fields.get("answer")
        if isinstance(answer, list) and answer and all(isinstance(a, str) for a in answer):
            answer = tuple(answer)
        elif not isinstance(answer, str):
            raise JlongError(f"{SETTING}: prompt {number} has no answer (a string, or a list of strings)")
        longest = len(prompt.ids) + config.eval.answers_max_new_tokens
        if longest > config.train.seq_len:
            raise JlongError(f"{SETTING}: prompt {number} has {len(prompt.ids):,} tokens, which with "
                             f"eval.answers_max_new_tokens ({config.eval.answers_max_new_tokens}) pass train.seq_len "
                             f"({config.train.seq_len:,})")
        trials.append(AnswerTrial(prompt, answer))
    return trials, encoder


def score(text: str, answer: str | tuple[str, ...]) -> float:
    """1 for an exact match of one answer (spaces around aside), or the share of the values the text holds."""
    if isinstance(answer, str):
        return float(text.strip() == answer.strip())
    return sum(value in text for value in answer) / len(answer)


def answer_accuracy(program, params, trials: list[AnswerTrial], encoder: PromptEncoder,
                    stop_ids: tuple[int, ...]) -> dict:
    """{trials, accuracy, by_length, answers}: the answers generated greedily with the program's model and
    parameters, scored."""
    config = program.config
    request = Request(config.eval.answers_max_new_tokens, SamplingSettings(temperature=0.0), stop_ids=stop_ids)
    completions = Sampler(program).generate(params, [t.prompt.ids for t in trials], request)
    texts = [_text(c, encoder) for c in completions]
    scores = [score(text, trial.answer) for text, trial in zip(texts, trials)]
    buckets: dict[int, list[float]] = {}
    for trial, value in zip(trials, scores):
        buckets.setdefault(1 << math.ceil(math.log2(len(trial.prompt.ids))), []).append(value)
    return {
        "trials": len(trials),
        "accuracy": sum(scores) / len(scores),
        "by_length": [{"up_to": up_to, "trials": len(values), "accuracy": sum(values) / len(values)}
                      for up_to, values in sorted(buckets.items())],
        "answers": [{"answer": trial.answer, "generated": text, "score": value}
                    for trial, text, value in list(zip(trials, texts, scores))[:SHOWN]],
    }


def _text(completion: Completion, encoder: PromptEncoder) -> str:
    """The answer's text without its stop id (bytes without a tokenizer)."""
    ids = completion.ids[:-1] if completion.finish_reason == "stop" else completion.ids
    text = encoder.decode(ids)
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace") if text is None else text
