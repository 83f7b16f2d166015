"""Which of jlong's GPU kernels have run on a GPU: the record `experiments/kernel_race.py` writes beside its
results when it runs on one (`experiments/results/kernel-runs.json` in the source tree). A kernel registry's
`auto` picks only kernels whose GPU kernels all appear in it, and the planner names every kernel it prices
without a measurement (`jlong.planner.pricing`).

A GPU kernel is known by its name in a compiled program (the Pallas kernel's name). It counts as run when a
race row that ran it on a GPU came out `ok` and none that ran it `failed`."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

RECORD_NAME = "kernel-runs.json"
# The committed record, in the source tree beside the race's results.
RECORD = Path(__file__).resolve().parent.parent / "experiments" / "results" / RECORD_NAME


@dataclasses.dataclass(frozen=True)
class KernelRuns:
    """The GPU kernels that have run on a GPU, and where that is recorded."""

    kernels: frozenset = frozenset()
    commit: str | None = None
    device: str | None = None
    source: str = "no record"

    def ran(self, names) -> bool:
        """Whether every GPU kernel of `names` has run on a GPU."""
        return set(names) <= self.kernels

    def describe(self) -> str:
        if self.commit is None:
            return self.source
        return f"{self.source}: the race at commit {self.commit} on {self.device}"


def from_record(record: dict, source: str) -> KernelRuns:
    """The kernels a record (the JSON `record` builds) counts as run."""
    kernels = record.get("kernels", {})
    ran = frozenset(name for name, rows in kernels.items() if rows.get("ok") and not rows.get("failed"))
    return KernelRuns(ran, record.get("commit"), record.get("device"), source)


@functools.cache
def recorded() -> KernelRuns:
    """The committed record; none (every GPU kernel counted as never run) where the source tree is absent."""
    if not RECORD.is_file():
        return KernelRuns(source=f"no record of GPU runs (experiments/results/{RECORD_NAME} is not here)")
    return from_record(json.loads(RECORD.read_text()), f"experiments/results/{RECORD_NAME}")


def record(rows: list[dict], kernels_of_row, *, commit: str | None, device: str | None, date: str | None,
           race: str, note: str | None = None) -> dict:
    """The record of a race on a GPU: for each GPU kernel its rows (`kernels_of_row(row)` gives the names of
    the GPU kernels a row of the race ran: none for another framework's), split into those that came out ok
    and those that failed. Rows not run name no kernel."""
    kernels: dict = {}
    for row in rows:
        if row["status"] not in ("ok", "failed"):
            continue
        shape = ", ".join(f"{key}={value}" for key, value in row["shape"].items())
        label = f"{row['kernel']} {row['impl']} {row['pass']} {shape}"
        for name in kernels_of_row(row):
            kernels.setdefault(name, {"ok": [], "failed": []})[row["status"]].append(label)
    found = {"commit": commit, "device": device, "date": date, "race": race,
             "kernels": {name: kernels[name] for name in sorted(kernels)}}
    return found | ({"note": note} if note else {})
