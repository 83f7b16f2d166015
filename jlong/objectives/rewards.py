"""GRPO's reward functions (`rl.rewards`), called as TRL calls them:

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns) -> [float or None, ...]

one value per completion (None: not scored by this function), `columns`
each other field of the prompts' records, repeated for each completion. With
a tokenizer, `prompts` and `completions` are text (or conversations: a
conversation's completion is `[{"role": "assistant", "content": text}]`);
without one, lists of ids. `completion_ids` always comes.

A function is named `module:function` (importable), `path/to/file.py:function`,
or by a built-in's name:

- `exact_answer`: 1.0 where the completion's final answer equals the
  record's `answer` (spaces around aside), else 0.0. The final answer is the
  last `<answer>...</answer>`, else what follows the last `####`, else the
  last `\\boxed{...}`, else the last non-empty line. Without a tokenizer the
  ids below 256 are read as UTF-8 bytes (byte-level models);
- `think_format`: 1.0 where the text opens with one `<think>...</think>`
  block (no second `<think>`), as TRL's think format reward, else 0.0.

A function that cannot be loaded stops the run before it starts, in one line.
One that raises, or returns the wrong number of values, or a value that is
no number, stops the run naming it (`RewardFailure`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jlong.errors import JlongError


class RewardFailure(JlongError):
    """A reward function failed during a run: the step is not taken."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    name: str  # as metrics name it: rewards/{name}/mean
    call: Callable
    weight: float


def exact_answer(prompts, completions, completion_ids, answer=None, **_):
    """1.0 where the completion's final answer equals `answer`."""
    if answer is None:
        raise ValueError("exact_answer needs an `answer` column in the prompts")
    return [float(final_answer(_as_text(c, ids)) == str(a).strip()) for c, ids, a in
            zip(completions, completion_ids, answer)]


def think_format(prompts, completions, completion_ids, **_):
    """1.0 where the text opens with one <think>...</think> block."""
    pattern = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL)
    return [float(bool(pattern.match(_as_text(c, ids)))) for c, ids in zip(completions, completion_ids)]


BUILT_IN = {"exact_answer": exact_answer, "think_format": think_format}


def final_answer(text: str) -> str:
    """The answer a completion ends on (see the module doc)."""
    if found := re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL):
        return found[-1].strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    if found := re.findall(r"\\boxed\{([^{}]*)\}", text):
        return found[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _as_text(completion, ids) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[0], dict):
        return str(completion[-1].get("content", ""))
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def load_rewards(names: tuple[str, ...], weights: tuple[float, ...] | None) -> list[RewardFunction]:
    """rl.rewards with rl.reward_weights (default 1 each), loaded and checked."""
    if weights is not None and len(weights) != len(names):
        raise JlongError(f"rl.reward_weights has {len(weights)} weights for {len(names)} reward functions: give one "
                         "each")
    functions = [RewardFunction(_name(spec), _load(spec), 1.0 if weights is None else float(w))
                 for spec, w in zip(names, weights or [None] * len(names))]
    if len({f.name for f in functions}) < len(functions):
        raise JlongError(f"rl.rewards names one function twice ({', '.join(names)}): each is logged by its name")
    return functions


def _name(spec: str) -> str:
    return spec.rpartition(":")[2] if ":" in spec else spec


def _load(spec: str) -> Callable:
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    where, colon, attribute = spec.rpartition(":")
    if not colon or not where or not attribute:
        raise JlongError(f"rl.rewards entry {spec!r} is no built-in ({', '.join(BUILT_IN)}) and not "
                         "module:function or path/to/file.py:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise JlongError(f"rl.rewards entry {spec!r}: {where!r} is not a file")
            loader = importlib.util.spec_from_file_location(f"jlong_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[loader.name] = module
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except JlongError:
        raise
    except Exception as err:  # whatever importing the user's module raises
        raise JlongError(f"rl.rewards entry {spec!r} cannot be imported ({type(err).__name__}: {err})") from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise JlongError(f"rl.rewards entry {spec!r}: {where} has no function {attribute!r}")
    return function


def score(functions: list[RewardFunction], *, prompts: list, completions: list, completion_ids: list[list[int]],
          columns: dict[str, list]) -> np.ndarray:
    """[completions, functions] float64, NaN where a function gave None; a failing function raises
    `RewardFailure` naming it."""
    count = len(completion_ids)
    table = np.full((count, len(functions)), np.nan)
    for j, function in enumerate(functions):
        try:
            values = function.call(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as err:  # the user's code: any error stops the run, named
            raise RewardFailure(f"reward function {function.name} raised {type(err).__name__}: {err}; the step was "
                                "not taken") from None
        values = list(values) if values is not None else []
        if len(values) != count:
            raise RewardFailure(f"reward function {function.name} returned {len(values)} values for {count} "
                                "completions; the step was not taken")
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(float(value)):
                raise RewardFailure(f"reward function {function.name} returned {value!r} for completion {i} (a "
                                    "number or None is needed); the step was not taken")
            table[i, j] = float(value)
    return table


def weighted(table: np.ndarray, functions: list[RewardFunction]) -> np.ndarray:
    """[completions] each completion's reward: the weighted sum of its functions' values, those not scored
    left out (TRL's nansum)."""
    weights = np.array([f.weight for f in functions])
    return np.nansum(table * weights, axis=1)
