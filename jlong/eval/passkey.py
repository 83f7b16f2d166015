"""Passkey retrieval: a number of `eval.passkey_digits` digits (five by default)
hidden at a depth of a filler context of a given length; the model is asked
to continue "The pass key is".

A trial is a token row whose first `length` tokens are the prompt: an
instruction, filler with the key's sentence at `depth` (0 = just after the
instruction, 1 = just before the question), the question, and the key's
digits. The rest of the row is more filler, which causal attention keeps
from the prompt, so one compiled program of the run's seq_len scores every
length. A trial is right when every digit of the key is the model's most
likely next token given the prompt and the digits before it: greedy decoding
of the answer, read from one forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jlong.errors import JlongError

INSTRUCTION = "There is a pass key hidden in this long text. Find it and remember it.\n"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "What is the pass key? The pass key is "


@dataclasses.dataclass(frozen=True)
class Trial:
    length: int
    depth: float
    row: np.ndarray  # [S + 1] token ids
    answer: np.ndarray  # positions in the row of the key's tokens


def shortest_prompt(encode: Callable[[str], list[int]], digits: int) -> int:
    """Tokens of a prompt without filler, with a key of `digits` digits."""
    key = "1" * digits
    return sum(len(encode(part)) for part in (INSTRUCTION, NEEDLE.format(key=key), QUESTION, key))


def candidate_lengths(seq_len: int) -> list[int]:
    """seq_len / 8, / 4, / 2 and seq_len."""
    return sorted({seq_len // d for d in (8, 4, 2, 1)})


def default_lengths(seq_len: int, shortest: int) -> list[int]:
    """The candidate lengths a prompt of `shortest` tokens fits in."""
    return [n for n in candidate_lengths(seq_len) if n >= shortest]


def trials(encode: Callable[[str], list[int]], seq_len: int, lengths, depths, count: int, seed: int,
           digits: int) -> list[Trial]:
    """`count` trials per (length, depth) cell, each with its own seeded key of `digits` digits."""
    filler = _filler_ids(encode, seq_len + 1)
    fixed = {part: encode(part) for part in (INSTRUCTION, QUESTION)}
    made = []
    for length in lengths:
        for d, depth in enumerate(depths):
            for trial in range(count):
                key = str(np.random.default_rng([seed, length, d, trial]).integers(10 ** (digits - 1), 10 ** digits))
                made.append(_trial(fixed, encode(NEEDLE.format(key=key)), encode(key), filler, length, depth, seq_len))
    return made


def _filler_ids(encode, tokens: int) -> list[int]:
    one = encode(FILLER)
    return (one * (tokens // len(one) + 1))[:tokens]


def _trial(fixed, needle, answer, filler, length, depth, seq_len) -> Trial:
    room = length - len(fixed[INSTRUCTION]) - len(needle) - len(fixed[QUESTION]) - len(answer)
    if room < 0:
        raise JlongError(f"a passkey prompt needs at least {length - room} tokens; eval.passkey_lengths has {length}")
    at = round(depth * room)
    prompt = fixed[INSTRUCTION] + filler[:at] + needle + filler[at:room] + fixed[QUESTION] + answer
    row = np.asarray(prompt + filler[: seq_len + 1 - len(prompt)], np.int32)
    return Trial(length, depth, row, np.arange(len(prompt) - len(answer), len(prompt)))


def accuracy(made: list[Trial], hits: np.ndarray) -> list[dict]:
    """[{length, depth, trials, accuracy, digit_accuracy}] from `hits` [len(made), S]: 1 where the
    next token is the model's most likely one (hits[i, p - 1] is that of row token p). `accuracy` counts
    trials with every digit right; `digit_accuracy` the key's tokens right (its digits, byte-level), each
    given the true ones before it, which shows partial retrieval that the exact match hides."""
    digits: dict[tuple[int, float], list[np.ndarray]] = {}
    for trial, row_hits in zip(made, hits):
        digits.setdefault((trial.length, trial.depth), []).append(row_hits[trial.answer - 1] > 0.5)
    return [{"length": length, "depth": depth, "trials": len(d), "accuracy": float(np.mean([x.all() for x in d])),
             "digit_accuracy": float(np.mean([x.mean() for x in d]))} for (length, depth), d in digits.items()]
