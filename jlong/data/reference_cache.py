"""DPO's reference log-probabilities kept beside a preference file:
`X.reference-logps.npz` for `X.npy` (for a directory of shards,
`reference-logps.npz` inside it).

The file holds each pair's (chosen, rejected) sums, which pairs have them
(`computed`), and the key they were made under (the digests of the file's
arrays and of the weights, the model and the compute dtype:
`jlong.objectives.dpo_reference.reference_key`). A run computes the pairs its rows
hold that the file lacks, so a later run at a longer train.seq_len adds
the pairs that fit only its rows. Values under another key are never read:
a run under another key computes its own and replaces them.

A writer merges its values with what the file holds under the same key,
writes them to a private file beside it and renames that over the cache:
however many processes write at once, a reader finds one whole file (the
last rename wins; pairs that only an earlier writer had are computed again
by a later run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from jlong.files import with_normal_permissions


def cache_path(path) -> Path:
    """Beside a preference file: X.reference-logps.npz (a directory of shards: inside it)."""
    path = Path(path if isinstance(path, (str, Path)) else path[0])
    return path / "reference-logps.npz" if path.is_dir() else path.with_suffix(".reference-logps.npz")


@dataclasses.dataclass
class Cached:
    """Each pair's reference (chosen, rejected) log-probabilities, and which pairs have them."""

    logps: np.ndarray  # [pairs, 2] float32, NaN where not computed
    computed: np.ndarray  # [pairs] bool

    @classmethod
    def empty(cls, pairs: int) -> Cached:
        return cls(np.full((pairs, 2), np.nan, np.float32), np.zeros(pairs, bool))


class ReferenceCache:
    def __init__(self, preference_path):
        self.path = cache_path(preference_path)

    def read(self, key: dict, pairs: int) -> tuple[Cached, str | None]:
        """What the file holds under `key` for a file of `pairs` pairs (nothing when it holds another key or
        cannot be read), and a line saying why it was not used (None: used, or no file)."""
        if not self.path.exists():
            return Cached.empty(pairs), None
        try:
            with np.load(self.path) as saved:
                made_by = json.loads(str(saved["key"]))
                cached = Cached(np.asarray(saved["logps"], np.float32), np.asarray(saved["computed"], bool))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            return Cached.empty(pairs), (f"{str(self.path)!r} cannot be read ({err}): this run computes the "
                                         "reference log-probabilities again and replaces it")
        if made_by != key:
            differing = ", ".join(sorted(k for k in {*key, *made_by} if made_by.get(k) != key.get(k)))
            return Cached.empty(pairs), (f"{str(self.path)!r} holds the reference log-probabilities of other "
                                         f"{differing}: this run computes its own and replaces them")
        if cached.logps.shape != (pairs, 2) or cached.computed.shape != (pairs,):
            return Cached.empty(pairs), (f"{str(self.path)!r} holds {len(cached.computed):,} pairs' reference "
                                         f"log-probabilities, not {pairs:,}: this run computes its own")
        return cached, None

    def write(self, key: dict, cached: Cached) -> str | None:
        """Keeps `cached` (with what the file already holds under `key`); a line when it could not."""
        held, _ = self.read(key, len(cached.computed))
        logps = np.where(cached.computed[:, None], cached.logps, held.logps)
        computed = cached.computed | held.computed
        try:
            handle, temporary = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".partial", dir=self.path.parent)
            try:
                with os.fdopen(handle, "wb") as f:
                    np.savez(f, logps=logps, computed=computed, key=json.dumps(key))
                with_normal_permissions(Path(temporary))
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as err:
            return (f"the reference log-probabilities could not be kept in {str(self.path)!r} ({err}); a later run "
                    "computes them again")
        return None
