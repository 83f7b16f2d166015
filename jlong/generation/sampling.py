"""Choosing each next token from the model's logits: greedy, or drawn after
temperature, top-k and top-p, in that order, as transformers' logits
processors apply them.

- temperature T > 0 divides the logits; T = 0 is greedy (the most likely
  token, the first of a tie);
- top-k keeps the k largest logits (0: all);
- top-p keeps the smallest set of the most likely tokens whose probability
  reaches p, the token that crosses p included (1: all).

Each token's log-probability is that of logits / T before top-k and top-p
cut anything (TRL's, the old log-probabilities of GRPO's ratio); greedy
gives the raw logits' log-softmax. Draws are keyed per sequence and step
(`row_keys`, `jax.random.fold_in`), so a sequence's tokens do not depend on
what else is in its batch, on the mesh, or on how decoding is cut into calls.
The settings are traced values: one compiled program serves them all.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jlong.errors import JlongError


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token

    def __post_init__(self):
        if not self.temperature >= 0:
            raise JlongError(f"the temperature must be 0 (greedy) or positive, got {self.temperature:g}")
        if self.top_k < 0:
            raise JlongError(f"top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise JlongError(f"top-p must be in (0, 1], got {self.top_p:g}")

    def as_arrays(self) -> dict[str, np.ndarray]:
        """The settings as the compiled program takes them (traced scalars)."""
        return {"temperature": np.float32(self.temperature), "top_k": np.int32(self.top_k),
                "top_p": np.float32(self.top_p)}


def row_keys(seed: int, prompt_indices, sample_indices) -> np.ndarray:
    """[R, 2] uint32: each sequence's key, from the seed, its prompt's index and its sample's."""
    keys = _row_keys(jax.random.PRNGKey(seed), np.asarray(prompt_indices, np.uint32),
                     np.asarray(sample_indices, np.uint32))
    return np.asarray(keys, np.uint32)


@jax.jit
def _row_keys(base, prompts, samples):
    return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompts, samples)


def allowed_logits(logits_RV, settings: dict):
    """(the log-probabilities of logits / T [R, V], the logits that may be drawn: logits / T with the tokens
    top-k and top-p cut at -inf). Greedy (T = 0) takes T as 1. The sorts the cuts need run only when a cut
    is asked for (a vocabulary of 150K sorted twice a token costs decoding time)."""
    temperature = jnp.where(settings["temperature"] > 0, settings["temperature"], 1.0)
    scaled = logits_RV.astype(jnp.float32) / temperature
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    cut = (settings["top_k"] > 0) | (settings["top_p"] < 1)
    return logprobs, jax.lax.cond(cut, functools.partial(_cut, settings=settings), lambda x: x, scaled)


def _cut(scaled, *, settings):
    """top-k, then top-p, of scaled logits: the tokens cut at -inf."""
    descending = -jnp.sort(-scaled, axis=-1)
    k = settings["top_k"]
    kth = jnp.take(descending, jnp.clip(k - 1, 0, scaled.shape[-1] - 1), axis=-1)[:, None]
    kept = jnp.where((k > 0) & (scaled < kth), -jnp.inf, scaled)
    descending = -jnp.sort(-kept, axis=-1)
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the tokens more likely than each
    within = (before < settings["top_p"]).at[:, 0].set(True)  # the most likely token always stays
    smallest = jnp.min(jnp.where(within, descending, jnp.inf), axis=-1, keepdims=True)
    return jnp.where(kept < smallest, -jnp.inf, kept)


def next_tokens(logits_RV, keys_R2, step, settings: dict):
    """(token [R] int32, its log-probability [R] float32) for each sequence at decoding step `step`."""
    logprobs, allowed = allowed_logits(logits_RV, settings)
    step_keys = jax.vmap(lambda key: jax.random.fold_in(key, step))(keys_R2)
    drawn = jax.vmap(jax.random.categorical)(step_keys, allowed)
    greedy = jnp.argmax(logits_RV, axis=-1)
    tokens = jnp.where(settings["temperature"] > 0, drawn, greedy).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
