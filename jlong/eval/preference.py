"""DPO's log-probabilities of whole preference pairs, outside the train step:
the reference's, computed once, and the metrics of held-out pairs.

With full fine-tuning the reference is the initial model. Rather than keep
a second copy of it beside the policy, a pass of the initial weights over
the preference file computes each pair's (chosen, rejected) sums of
completion log-probabilities before step 1, and every batch then carries
its rows' values (`Batches.use_reference`). A document's sum does not
depend on the row it is packed into (attention and positions restart at
every document), so one pass serves every later packing.

The values are cached beside the token file (`X.reference-logps.npz`) with
what made them: the model, its starting weights, the compute dtype and the
file's pairs. A later run of the same model reads them; a run of another
model is refused in one line rather than trained against the wrong
reference.

`jlong eval` of a DPO run scores held-out pairs (`eval.path`, a file of
`jlong prepare --preference`) by the same sums, policy against reference,
and reports TRL's metrics (`held_out_metrics`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import numpy as np

from jlong.config import Config
from jlong.data.pairs import PreferencePairs
from jlong.data.sources import REFERENCE_LOGPS, document_structure
from jlong.errors import JlongError
from jlong.files import free_name
from jlong.program.initial_weights import check_init_from
from jlong.program.train_program import TrainProgram


def cache_path(path) -> Path:
    """Beside a preference file: X.reference-logps.npz (a directory of shards: inside it)."""
    path = Path(path if isinstance(path, str) else path[0])
    return path / "reference-logps.npz" if path.is_dir() else path.with_suffix(".reference-logps.npz")


def identity(config: Config, source: PreferencePairs) -> dict:
    """What the cached values depend on: the whole model section (RoPE too),
    the starting weights (train.init_from's, model.hf_path's or the seed's),
    the compute dtype and the file's pairs."""
    initial = check_init_from(config)
    weights = (initial.describe() if initial else config.model.hf_path) or f"random, train.seed {config.train.seed}"
    return {"model": config.model.model_dump(mode="json"), "weights": weights,
            "compute_dtype": config.train.compute_dtype, "pairs": int(len(source.starts)),
            "tokens": int(len(source.tokens)), "pair_starts_sum": int(source.starts.sum())}


def reference_logps(program: TrainProgram, source: PreferencePairs, path, params: dict | None, say) -> np.ndarray:
    """[pairs, 2] each pair's (chosen, rejected) log-probability under the
    initial model, for the preference file at `path`: read from its cache,
    or computed with the initial weights (`params`, or the run's starting
    weights, `TrainProgram.starting_params`, when None) and cached."""
    cache, wanted = cache_path(path), identity(program.config, source)
    if cache.exists():
        with np.load(cache) as saved:
            made_by = json.loads(str(saved["identity"]))
            if made_by != wanted:
                differing = sorted(key for key in wanted if made_by.get(key) != wanted[key])
                raise JlongError(f"{str(cache)!r} holds the reference log-probabilities of another model or file "
                                 f"({', '.join(differing)} differ): move it aside, and this run computes its own")
            say(f"DPO's reference: the initial model's log-probabilities of {len(source.starts):,} pairs, read "
                f"from {cache}")
            return saved["logps"]
    logps = pair_logps(program, source, program.starting_params() if params is None else params)
    temporary = free_name(cache.with_name(cache.name + ".partial"))
    with open(temporary, "wb") as f:
        np.savez(f, logps=logps, identity=json.dumps(wanted))
    temporary.rename(cache)
    say(f"DPO's reference: the initial model's log-probabilities of {len(source.starts):,} pairs, computed once "
        f"and kept in {cache}")
    return logps


def pair_logps(program: TrainProgram, source: PreferencePairs, params: dict, rows: int | None = None) -> np.ndarray:
    """[pairs, 2] each pair's (chosen, rejected) sum of completion log-probabilities under `params`, by one
    pass over the first pass's rows (the first `rows` of them; the pairs of the rest are NaN), a batch at a time."""
    keys, forward = _forward(program)
    logps = np.full((len(source.starts), 2), np.nan, np.float32)
    rows, B = min(source.rows_per_epoch(0), rows or np.inf), program.config.train.batch_size
    for first in range(0, rows, B):
        indices = [min(i, rows - 1) for i in range(first, first + B)]  # the last batch repeats its last row
        batch = _rows(source, indices, program.config.data.eos_id)
        values = np.asarray(jax.device_get(forward(params, program.place_batch({k: batch[k] for k in keys}))))
        for b, i in enumerate(indices):
            pairs = source.pairs_of(i)
            logps[pairs] = values[b, :2 * len(pairs)].reshape(-1, 2)
    return logps


@functools.cache
def _forward(program: TrainProgram):
    """(the batch keys, the jitted (params, batch) -> [B, N] per-slot log-probabilities): one per
    program, so the policy's and the reference's passes share a compiled program."""
    count = program.config.attention.max_documents
    keys = [key for key in program.abstract_batch if key != REFERENCE_LOGPS]
    forward = jax.jit(
        lambda params, batch: program.bind(program.optimizer.compute_params(params, program.param_shardings))
        .document_logps_and_routing(batch, count)[0],
        in_shardings=(program.rest_shardings, {key: program.batch_shardings[key] for key in keys}))
    return keys, forward


def held_out_pairs(config: Config) -> PreferencePairs:
    """eval.path's preference pairs in rows of the run's length (`jlong prepare --preference`)."""
    from jlong.data.corpus import TokenCorpus

    train = config.train
    return PreferencePairs(TokenCorpus(config.eval.path, "eval.path"), seq_len=train.seq_len, batch_size=1,
                           seed=train.seed, eos_id=config.data.eos_id, max_documents=config.attention.max_documents)


def held_out_metrics(program: TrainProgram, params: dict, say) -> dict:
    """TRL's metrics of eval.path's pairs (its first eval.sequences rows): the
    policy `params` against the run's reference (LoRA: its base, the adapters
    off; full fine-tuning: the initial model, `reference_logps`)."""
    config = program.config
    source = held_out_pairs(config)
    policy = pair_logps(program, source, params, config.eval.sequences)
    if program.lora:
        reference = pair_logps(program, source, program.with_saved(params, jax.tree.map(
            lambda a: np.zeros(a.shape, a.dtype), program.saved(params))), config.eval.sequences)
    else:
        reference = reference_logps(program, source, config.eval.path, None, say)
    scored = ~np.isnan(policy[:, 0])
    chosen, rejected = (program.config.train.dpo_beta * (policy[scored, i] - reference[scored, i]) for i in (0, 1))
    return {"pairs": int(scored.sum()), "rewards/chosen": float(chosen.mean()),
            "rewards/rejected": float(rejected.mean()), "rewards/accuracies": float((chosen > rejected).mean()),
            "rewards/margins": float((chosen - rejected).mean()), "logps/chosen": float(policy[scored, 0].mean()),
            "logps/rejected": float(policy[scored, 1].mean()),
            "loss": float(np.mean(np.logaddexp(0.0, -(chosen - rejected).astype(np.float64))))}


def _rows(source: PreferencePairs, indices: list[int], eos_id: int) -> dict[str, np.ndarray]:
    """The batch arrays of rows `indices` of the pairs, as `Batches.batch` lays out a step's."""
    sequences = np.stack([source.row(i) for i in indices])
    slots = np.stack([source.slot_row(i) for i in indices])[:, 1:]
    inputs = sequences[:, :-1]
    return {"inputs": inputs, "targets": sequences[:, 1:], "loss_mask": slots >= 0, "pair_documents": slots,
            **document_structure(inputs, eos_id)}
