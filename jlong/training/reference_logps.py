"""DPO with full fine-tuning: the reference's log-probabilities, computed once.

The reference is the initial model. Rather than keep a second copy of it
beside the policy, a pass of the initial weights over the preference file
computes each pair's (chosen, rejected) sums of completion log-probabilities
before step 1, and every batch then carries its rows' values
(`Batches.use_reference`). A document's sum does not depend on the row it
is packed into (attention and positions restart at every document), so one
pass serves every later packing.

The values are cached beside the token file (`X.reference-logps.npz`) with
what made them: the model, its starting weights, the compute dtype and the
file's pairs. A later run of the same model reads them; a run of another
model is refused in one line rather than trained against the wrong
reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from jlong.config import Config
from jlong.config.loading import WEIGHT_DEFINING_FIELDS
from jlong.data.pairs import PreferencePairs
from jlong.data.sources import REFERENCE_LOGPS, Batches, document_structure
from jlong.errors import JlongError
from jlong.files import free_name
from jlong.program.train_program import TrainProgram


def cache_path(config: Config) -> Path:
    """Beside the preference file: X.reference-logps.npz (a directory of shards: inside it)."""
    path = Path(config.data.path if isinstance(config.data.path, str) else config.data.path[0])
    return path / "reference-logps.npz" if path.is_dir() else path.with_suffix(".reference-logps.npz")


def identity(config: Config, source: PreferencePairs) -> dict:
    """What the cached values depend on."""
    model = config.model.model_dump(mode="json")
    weights = config.model.hf_path or f"random, train.seed {config.train.seed}"
    return {"model": {key: model[key] for key in WEIGHT_DEFINING_FIELDS if key in model}, "weights": weights,
            "compute_dtype": config.train.compute_dtype, "pairs": int(len(source.starts)),
            "tokens": int(len(source.tokens)), "pair_starts_sum": int(source.starts.sum())}


def reference_logps(program: TrainProgram, batches: Batches, params: dict | None, say) -> np.ndarray:
    """[pairs, 2] each pair's (chosen, rejected) reference log-probability: read
    from the cache, or computed with the initial weights (`params`, or the
    run's starting weights when None) and cached."""
    config, source = program.config, batches.source
    path, wanted = cache_path(config), identity(config, source)
    if path.exists():
        with np.load(path) as saved:
            made_by = json.loads(str(saved["identity"]))
            if made_by != wanted:
                differing = sorted(key for key in wanted if made_by.get(key) != wanted[key])
                raise JlongError(f"{str(path)!r} holds the reference log-probabilities of another model or file "
                                 f"({', '.join(differing)} differ): move it aside, and this run computes its own")
            say(f"DPO's reference: the initial model's log-probabilities of {len(source.starts):,} pairs, read "
                f"from {path}")
            return saved["logps"]
    params = program.starting_params() if params is None else params
    logps = _computed(program, source, params)
    temporary = free_name(path.with_name(path.name + ".partial"))
    with open(temporary, "wb") as f:
        np.savez(f, logps=logps, identity=json.dumps(wanted))
    temporary.rename(path)
    say(f"DPO's reference: the initial model's log-probabilities of {len(source.starts):,} pairs, computed once "
        f"and kept in {path}")
    return logps


def _computed(program: TrainProgram, source: PreferencePairs, params: dict) -> np.ndarray:
    """One pass of the weights over every pair that fits a row (the first pass's rows, a batch at a time)."""
    count = program.config.attention.max_documents
    keys = [key for key in program.abstract_batch if key != REFERENCE_LOGPS]
    forward = jax.jit(
        lambda params, batch: program.bind(program.optimizer.compute_params(params, program.param_shardings))
        .document_logps_and_routing(batch, count)[0],
        in_shardings=(program.rest_shardings, {key: program.batch_shardings[key] for key in keys}))
    logps = np.full((len(source.starts), 2), np.nan, np.float32)
    rows, B = source.rows_per_epoch(0), program.config.train.batch_size
    for first in range(0, rows, B):
        indices = [min(i, rows - 1) for i in range(first, first + B)]  # the last batch repeats its last row
        batch = _rows(source, indices, program.config.data.eos_id)
        values = np.asarray(jax.device_get(forward(params, program.place_batch({k: batch[k] for k in keys}))))
        for b, i in enumerate(indices):
            pairs = source.pairs_of(i)
            logps[pairs] = values[b, :2 * len(pairs)].reshape(-1, 2)
    return logps


def _rows(source: PreferencePairs, indices: list[int], eos_id: int) -> dict[str, np.ndarray]:
    """The batch arrays of rows `indices` of the pairs, as `Batches.batch` lays out a step's."""
    sequences = np.stack([source.row(i) for i in indices])
    slots = np.stack([source.slot_row(i) for i in indices])[:, 1:]
    inputs = sequences[:, :-1]
    return {"inputs": inputs, "targets": sequences[:, 1:], "loss_mask": slots >= 0, "pair_documents": slots,
            **document_structure(inputs, eos_id)}
