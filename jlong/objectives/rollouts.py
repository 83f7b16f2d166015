"""GRPO's rollouts: the completions of a step's prompts, their rewards, their
advantages, and the rows they are trained in.

Two sources:

- jlong's sampler: `rl.prompts_per_step` prompts of `rl.prompts` a step (in
  file order, around again at the end), `rl.num_generations` completions each
  from jlong's sampler on the training mesh with the current weights
  (`jlong.generation`), each group's draws keyed by the seed, the step's group
  of steps and the prompt, then scored by the reward functions;
- a file of another engine's rollouts (`rl.rollouts`, JSON Lines, Parquet or a datasets directory of
  `prompt_ids`, `completion_ids`, `logprobs`, `reward` or one field per
  reward function, and `group`), `rl.prompts_per_step` groups a step in file
  order.

With `rl.num_iterations` = k, one batch of rollouts serves k steps in a row,
against the log-probabilities it was sampled with (the file's as they stand).

Advantages are TRL's: A = (r - the group's mean) / (the group's unbiased
standard deviation + 1e-4), the deviation per group, over the whole batch
(`scale_rewards: batch`) or none at all (`none`).

Rows (`rows`): each completion with its prompt is one document, packed
first-fit into the step's rows as preference pairs are packed: documents
never cross rows, a row's documents never see each other (segments, and
positions restart), and only completion tokens carry loss.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from jlong.data.prompts import Prompt
from jlong.data.readers import whole_records
from jlong.errors import JlongError
from jlong.objectives.rewards import RewardFunction, score, weighted

STD_EPSILON = 1e-4  # TRL's, added to the deviation


@dataclasses.dataclass
class Rollouts:
    """One batch of completions, group-major (G completions of one prompt in a row)."""

    groups: int  # G, completions per prompt
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    old_logprobs: list[list[float]]  # per completion token: the sampler's (or the file's)
    rewards: np.ndarray  # [N, functions] float64, NaN: not scored
    reward_names: list[str]
    total: np.ndarray  # [N] each completion's reward (weighted sum)
    terminated: np.ndarray  # [N] bool: it ended with a stop id (not cut at max_new_tokens)
    prompt_indices: list[int]  # [N] the prompt each completion answers (its record in rl.prompts, or group)
    seconds: float = 0.0  # the rollout's time
    tokens_per_s: float = 0.0  # the sampler's

    @property
    def count(self) -> int:
        return len(self.completion_ids)

    def to_json(self) -> dict:
        return {"groups": self.groups, "prompt_ids": self.prompt_ids, "completion_ids": self.completion_ids,
                "old_logprobs": self.old_logprobs, "rewards": np.where(np.isnan(self.rewards), None, self.rewards)
                .tolist(), "reward_names": self.reward_names, "total": self.total.tolist(),
                "terminated": self.terminated.tolist(), "prompt_indices": self.prompt_indices}

    @classmethod
    def from_json(cls, record: dict) -> Rollouts:
        rewards = np.array([[np.nan if v is None else v for v in row] for row in record["rewards"]], np.float64)
        return cls(record["groups"], record["prompt_ids"], record["completion_ids"], record["old_logprobs"],
                   rewards.reshape(len(record["completion_ids"]), -1), record["reward_names"],
                   np.asarray(record["total"], np.float64), np.asarray(record["terminated"], bool),
                   record["prompt_indices"])


def advantages(total: np.ndarray, groups: int, scale: str) -> np.ndarray:
    """[N] TRL's advantages of group-major rewards: each minus its group's mean, over the deviation
    `scale` names (group, batch, none) plus 1e-4."""
    grouped = total.reshape(-1, groups)
    centred = (grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1)
    if scale == "none":
        return centred
    if scale == "group":
        deviation = np.repeat(grouped.std(axis=1, ddof=1), groups)
    else:
        deviation = np.full_like(centred, total.std(ddof=1))
    return centred / (deviation + STD_EPSILON)


def rollout_metrics(rollouts: Rollouts, max_new_tokens: int) -> dict[str, float]:
    """TRL's rollout metrics: rewards (whole, per function), their spread within groups, completion lengths."""
    grouped = rollouts.total.reshape(-1, rollouts.groups)
    deviation = grouped.std(axis=1, ddof=1)
    lengths = np.array([len(ids) for ids in rollouts.completion_ids])
    terminated = lengths[rollouts.terminated]
    metrics = {
        "reward": float(rollouts.total.mean()),
        "reward_std": float(deviation.mean()),
        "frac_reward_zero_std": float(np.isclose(deviation, 0.0).mean()),
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(1 - rollouts.terminated.mean()),
        "completions/mean_terminated_length": float(terminated.mean()) if len(terminated) else 0.0,
        "completions/min_terminated_length": float(terminated.min()) if len(terminated) else 0.0,
        "completions/max_terminated_length": float(terminated.max()) if len(terminated) else 0.0,
    }
    for j, name in enumerate(rollouts.reward_names):
        values = rollouts.rewards[:, j]
        scored = values[~np.isnan(values)]
        metrics[f"rewards/{name}/mean"] = float(scored.mean()) if len(scored) else float("nan")
        metrics[f"rewards/{name}/std"] = float(scored.std(ddof=1)) if len(scored) > 1 else 0.0
    del max_new_tokens  # TRL's clipped ratio counts completions without a stop id, whatever their length
    return metrics


def rows(rollouts: Rollouts, advantage: np.ndarray, *, seq_len: int, batch_size: int, max_documents: int,
         mask_truncated: bool) -> dict[str, np.ndarray]:
    """The step's [batch_size, seq_len] arrays: inputs, targets, segment_ids, positions; loss_mask (the
    completion targets, without those of truncated completions with `mask_truncated`), old_logps and
    advantages at them, and documents (each completion target's slot among its row's documents, -1 elsewhere)."""
    B, S = batch_size, seq_len
    tokens = np.zeros((B, S + 1), np.int32)
    segments = np.full((B, S + 1), -1, np.int32)
    positions = np.zeros((B, S + 1), np.int32)
    out = {"loss_mask": np.zeros((B, S), bool), "old_logps": np.zeros((B, S), np.float32),
           "advantages": np.zeros((B, S), np.float32), "documents": np.full((B, S), -1, np.int32)}
    used, slots = [0] * B, [0] * B
    for i, (prompt, completion) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids)):
        document = prompt + completion
        length = len(document)
        row = next((b for b in range(B) if used[b] + length <= S + 1 and slots[b] < max_documents), None)
        if row is None:
            raise JlongError(f"the step's {rollouts.count} completions and their prompts do not fit train.batch_size "
                             f"({B}) rows of train.seq_len ({S}) tokens, {max_documents} documents a row "
                             "(attention.max_documents): raise train.batch_size, or train.seq_len")
        at = used[row]
        tokens[row, at:at + length] = document
        segments[row, at:at + length] = slots[row]
        positions[row, at:at + length] = np.arange(length)
        # target j of the row is token j + 1: completion token k is the target at at + len(prompt) + k - 1
        first = at + len(prompt) - 1
        span = slice(first, first + len(completion))
        if not (mask_truncated and not rollouts.terminated[i]):
            out["loss_mask"][row, span] = True
        out["old_logps"][row, span] = rollouts.old_logprobs[i]
        out["advantages"][row, span] = advantage[i]
        out["documents"][row, span] = slots[row]
        used[row] += length
        slots[row] += 1
    ends = segments[:, :-1] < 0  # padding: a segment of its own after the row's documents
    segments[:, :-1][ends] = np.broadcast_to(np.array(slots)[:, None], segments[:, :-1].shape)[ends]
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
            "positions": positions[:, :-1], **out}


def read_rollouts_file(path: str | Path, *, groups: int, functions: list[RewardFunction], vocab_size: int,
                       max_new_tokens: int, seq_len: int, stop_ids: tuple[int, ...]) -> list[Rollouts]:
    """Another engine's rollouts, one `Rollouts` per group of `groups` completions, in file order; checked in
    one line: the fields, each group's size, ids in the vocabulary, one logprob per id, the lengths. A
    rollout's reward is its `reward`, or the weighted sum of its fields named as rl.rewards' functions."""
    path = Path(path)
    if not path.exists():
        raise JlongError(f"rl.rollouts {str(path)!r} does not exist")
    by_group: dict[object, list[tuple[dict, str]]] = {}
    for record, where in whole_records(path):
        fields = ("prompt_ids", "completion_ids", "logprobs", "group")
        if missing := [f for f in fields if f not in record]:
            raise JlongError(f"rl.rollouts: {where} has no {missing[0]!r} (a rollout has {', '.join(fields)} and "
                             "its reward)")
        by_group.setdefault(record["group"], []).append((record, f"rl.rollouts: {where}"))
    if not by_group:
        raise JlongError(f"rl.rollouts {str(path)!r} holds no rollouts")
    batches = []
    for index, (group, records) in enumerate(by_group.items()):
        if len(records) != groups:
            raise JlongError(f"rl.rollouts group {group!r} has {len(records)} completions; rl.num_generations is "
                             f"{groups}")
        batches.append(_group(records, index, functions, vocab_size, max_new_tokens, seq_len, stop_ids))
    return batches


def _group(records, index, functions, vocab_size, max_new_tokens, seq_len, stop_ids) -> Rollouts:
    prompts, completions, logprobs, rewards, terminated = [], [], [], [], []
    whole = all("reward" in r for r, _ in records)
    names = ["reward"] if whole else [f.name for f in functions]
    for record, where in records:
        prompt, completion, logp = record["prompt_ids"], record["completion_ids"], record["logprobs"]
        for name, ids in (("prompt_ids", prompt), ("completion_ids", completion)):
            if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
                raise JlongError(f"{where}: {name} must be ids of the model's vocabulary (0 to {vocab_size - 1})")
        if not prompt:
            raise JlongError(f"{where}: the prompt has no tokens")
        if len(logp) != len(completion):
            raise JlongError(f"{where} has {len(logp)} logprobs for {len(completion)} completion ids")
        if len(completion) > max_new_tokens:
            raise JlongError(f"{where} has {len(completion)} completion ids, more than rl.max_new_tokens "
                             f"({max_new_tokens})")
        if len(prompt) + max_new_tokens > seq_len:
            raise JlongError(f"{where}: a prompt of {len(prompt):,} tokens and rl.max_new_tokens ({max_new_tokens:,}) "
                             f"pass train.seq_len ({seq_len:,})")
        if missing := [n for n in names if n not in record]:
            raise JlongError(f"{where} has no {missing[0]!r} reward (the rollouts carry `reward`, or one field per "
                             "function of rl.rewards)")
        values = [record[n] for n in names]
        if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
            raise JlongError(f"{where}: a reward must be a number or null")
        reason = record.get("finish_reason")
        terminated.append(reason == "stop" if reason else bool(completion) and completion[-1] in stop_ids)
        prompts.append(prompt)
        completions.append(completion)
        logprobs.append([float(v) for v in logp])
        rewards.append([np.nan if v is None else float(v) for v in values])
    table = np.array(rewards, np.float64).reshape(len(records), len(names))
    total = np.nansum(table, axis=1) if whole else weighted(table, functions)
    return Rollouts(len(records), prompts, completions, logprobs, table, names, total, np.array(terminated),
                    [index] * len(records))


def score_completions(functions: list[RewardFunction], prompts: list[Prompt], completion_ids: list[list[int]],
                      groups: int, decode) -> tuple[np.ndarray, np.ndarray]:
    """([N, functions], [N]) the reward functions' values and their weighted sums, for group-major completions
    of `prompts`; `decode` is ids -> text (None without a tokenizer: prompts and completions as ids)."""
    given = [p.given for p in prompts for _ in range(groups)]
    if decode is None:
        prompt_values = [p.ids for p in prompts for _ in range(groups)]
        completions = completion_ids
    else:
        prompt_values = given
        texts = [decode(ids) for ids in completion_ids]
        completions = [[{"role": "assistant", "content": t}] if isinstance(g, list) else t
                       for g, t in zip(given, texts)]
    columns = {key: [p.fields.get(key) for p in prompts for _ in range(groups)]
               for key in dict.fromkeys(k for p in prompts for k in p.fields)}
    table = score(functions, prompts=prompt_values, completions=completions, completion_ids=completion_ids,
                  columns=columns)
    return table, weighted(table, functions)
