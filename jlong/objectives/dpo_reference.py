"""DPO's log-probabilities of whole preference pairs, outside the train step:
the reference policy's, computed once, and the metrics of held-out pairs.

With full fine-tuning the reference policy is the initial model. Rather than keep
a second copy of it beside the policy, a pass of the initial weights over
the preference file computes each pair's (chosen, rejected) sums of
completion log-probabilities before the run holds any other weights, and
every batch then carries its rows' values (`Batches.use_reference`). A
document's sum does not depend on the row it is packed into (attention and
positions restart at every document), so one pass serves every later
packing and every row length.

The values are cached beside the token file (`jlong.data.reference_cache`)
under a key of contents: the digests of the file's token, mask and pair
arrays and of the initial weights' files, the model section, the compute
dtype and the end id (`reference_key`). A run reads the pairs its rows
need from there and computes those it lacks (the pairs that fit only a
longer row than earlier runs', all of them after the file or the weights
changed); a trained pair's reference is never missing.

`jlong eval` of a DPO run scores held-out pairs (`eval.path`, a file of
`jlong prepare --preference`) by the same sums, policy against reference,
and reports TRL's metrics (`held_out_metrics`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jlong.checkpoint import weights_kind
from jlong.config import Config
from jlong.data.corpus import TokenCorpus, mask_path
from jlong.data.pairs import PreferencePairs
from jlong.data.reference_cache import Cached, ReferenceCache
from jlong.data.sources import REFERENCE_LOGPS, document_structure
from jlong.digests import array_digest, checkpoint_digest, hf_digest
from jlong.init_from import check_init_from
from jlong.parallel.placement import replicated


def reference_key(config: Config, source: PreferencePairs) -> dict:
    """What the cached values depend on: the file's arrays, the starting weights' files (or the seed
    of random ones), the whole model section (RoPE too), the compute dtype and the end id."""
    tokens = source.tokens
    masks = [np.load(mask_path(f), mmap_mode="r") for f in tokens.files if mask_path(f).is_file()]
    return {"data": array_digest([*tokens.arrays, *masks, source.starts, source.rejected]),
            "weights": starting_weights_digest(config), "model": config.model.model_dump(mode="json"),
            "compute_dtype": config.train.compute_dtype, "eos_id": config.data.eos_id}


def starting_weights_digest(config: Config) -> str:
    """The digest of the run's starting weights (`jlong.digests`): train.init_from's, model.hf_path's, or
    the seed's words for random ones."""
    initial = check_init_from(config)
    if initial and initial.kind == "jlong":
        return checkpoint_digest(Path(initial.path) / str(initial.step))
    path = initial.path if initial else config.model.hf_path
    if path and weights_kind(path, "the starting weights") == "hf":
        return hf_digest(path)
    return f"random, train.seed {config.train.seed}"


def reference_logps(config: Config, source: PreferencePairs, path, compute: Callable[[np.ndarray], np.ndarray],
                    say, pairs: np.ndarray | None = None) -> np.ndarray:
    """[pairs, 2] each pair's (chosen, rejected) log-probability under the
    run's initial weights, finite for every one of `pairs` (default: every
    pair that fits a row of `source`): read from the cache beside the
    preference file at `path`, the rest computed by `compute(missing)` (a
    [pairs, 2] array; every process runs it) and kept there by the first process."""
    needed = source.kept if pairs is None else np.asarray(pairs)
    cache, first = ReferenceCache(path), jax.process_index() == 0
    key = reference_key(config, source) if first else None
    cached, note = cache.read(key, len(source.starts)) if first else (Cached.empty(len(source.starts)), None)
    if jax.process_count() > 1:  # every process computes what the first process's cache lacks
        from jax.experimental import multihost_utils

        logps, computed = multihost_utils.broadcast_one_to_all((cached.logps, cached.computed))
        cached = Cached(np.array(logps), np.array(computed))
    if note:
        say(note)
    missing = needed[~cached.computed[needed]]
    where = f"the initial model's log-probabilities of {len(needed):,} pairs"
    if not len(missing):
        say(f"DPO's reference: {where}, read from {cache.path}")
        return cached.logps
    values = compute(missing)
    cached.logps[missing], cached.computed[missing] = values[missing], True
    if first and (failed := cache.write(key, cached)):
        say(failed)
    read = f", {len(needed) - len(missing):,} of them read from there" if len(missing) < len(needed) else ""
    say(f"DPO's reference: {where}, {len(missing):,} computed and kept in {cache.path}{read}")
    if not np.isfinite(cached.logps[needed]).all():
        raise RuntimeError("a preference pair's reference log-probabilities are not finite")
    return cached.logps


def from_starting_weights(make_program: Callable, source: PreferencePairs) -> Callable[[np.ndarray], np.ndarray]:
    """`compute` for `reference_logps`: the run's starting weights, read into the program `make_program()`
    gives (of the config's layout and length) when called, and dropped when it returns, over the pairs asked
    for."""
    def compute(pairs: np.ndarray) -> np.ndarray:
        program = make_program()
        return pair_logps(program, source, program.starting_params(), pairs)

    return compute


def pair_logps(program, source: PreferencePairs, params: dict,
               pairs: np.ndarray | None = None) -> np.ndarray:
    """[pairs, 2] each pair's (chosen, rejected) sum of completion log-probabilities under `params`, for
    `pairs` (default: every pair that fits a row; NaN for the others), packed into rows as the first pass
    packs them and computed a batch of rows at a time."""
    pairs = source.kept if pairs is None else np.asarray(pairs)
    if not np.isin(pairs, source.kept).all():
        raise ValueError("pair_logps: some pairs do not fit a row of this program's length")
    keys, forward = _forward(program)
    logps = np.full((len(source.starts), 2), np.nan, np.float32)
    rows, B = source.rows_of_pairs(pairs), program.config.train.batch_size
    for first in range(0, len(rows), B):
        held = [rows[min(i, len(rows) - 1)] for i in range(first, first + B)]  # the last batch repeats its last row
        batch = _rows(source, held, program.config.data.eos_id)
        values = np.asarray(forward(params, program.place_batch({k: batch[k] for k in keys})).addressable_data(0))
        for b, row_pairs in enumerate(held):
            logps[row_pairs] = values[b, :2 * len(row_pairs)].reshape(-1, 2)
    return logps


@functools.cache
def _forward(program):
    """(the batch keys, the jitted (params, batch) -> [B, N] per-slot log-probabilities, whole on every
    device): one per program, so the policy's and the reference's passes share a compiled program."""
    count = program.config.attention.max_documents
    keys = [key for key in program.abstract_batch if key != REFERENCE_LOGPS]
    forward = jax.jit(
        lambda params, batch: program.bind(program.optimizer.compute_params(params, program.param_shardings))
        .document_logps_and_routing(batch, count)[0],
        in_shardings=(program.rest_shardings, {key: program.batch_shardings[key] for key in keys}),
        out_shardings=replicated(program.mesh))
    return keys, forward


def held_out_pairs(config: Config) -> tuple[PreferencePairs, np.ndarray]:
    """eval.path's preference pairs in rows of the run's length (`jlong prepare --preference`), and the
    pairs scored: those of its first eval.sequences rows."""
    train = config.train
    source = PreferencePairs(TokenCorpus(config.eval.path, "eval.path"), seq_len=train.seq_len, batch_size=1,
                             seed=train.seed, eos_id=config.data.eos_id,
                             max_documents=config.attention.max_documents)
    rows = min(config.eval.sequences, source.rows_per_epoch(0))
    return source, np.concatenate([source.pairs_of(i) for i in range(rows)])


def held_out_reference(program, say) -> np.ndarray:
    """Full fine-tuning: the initial model's log-probabilities of the scored held-out pairs, from the cache
    beside eval.path or computed with the starting weights. Call it before the weights to score are on the
    devices: computing reads the starting weights onto them."""
    config = program.config
    source, scored = held_out_pairs(config)
    return reference_logps(config, source, config.eval.path,
                           lambda pairs: pair_logps(program, source, program.starting_params(), pairs), say, scored)


def held_out_metrics(program, params: dict, reference: np.ndarray | None = None, say=print) -> dict:
    """TRL's metrics of eval.path's pairs (those of its first eval.sequences
    rows): the policy `params` against the run's reference (LoRA: its base,
    the adapters off; full fine-tuning: the initial model's, `reference`, or
    `held_out_reference`'s when None)."""
    config = program.config
    source, scored = held_out_pairs(config)
    policy = pair_logps(program, source, params, scored)
    if program.lora:
        reference = pair_logps(program, source, program.with_saved(params, jax.tree.map(
            lambda a: np.zeros(a.shape, a.dtype), program.saved(params))), scored)
    elif reference is None:
        reference = held_out_reference(program, say)
    policy, reference = policy[scored], reference[scored]
    chosen, rejected = (config.train.dpo_beta * (policy[:, i] - reference[:, i]) for i in (0, 1))
    return {"pairs": len(scored), "rewards/chosen": float(chosen.mean()),
            "rewards/rejected": float(rejected.mean()), "rewards/accuracies": float((chosen > rejected).mean()),
            "rewards/margins": float((chosen - rejected).mean()), "logps/chosen": float(policy[:, 0].mean()),
            "logps/rejected": float(policy[:, 1].mean()),
            "loss": float(np.mean(np.logaddexp(0.0, -(chosen - rejected).astype(np.float64))))}


def _rows(source: PreferencePairs, rows: list[np.ndarray], eos_id: int) -> dict[str, np.ndarray]:
    """The batch arrays of rows of these pairs, as `Batches.batch` lays out a step's."""
    sequences = np.stack([source.row_of(pairs) for pairs in rows])
    slots = np.stack([source.slot_row_of(pairs) for pairs in rows])[:, 1:]
    inputs = sequences[:, :-1]
    return {"inputs": inputs, "targets": sequences[:, 1:], "loss_mask": slots >= 0, "pair_documents": slots,
            **document_structure(inputs, eos_id)}
