"""How much of each GPU a run asks XLA for, so that it is what the plan budgets.

JAX preallocates a share of each GPU's memory for XLA's pool (75% unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise). `jlong train` sets that
share from `train.gpu_memory_fraction` before jax starts, unless the user
exported a value, and the planner's default device budget is the same share
less a reserve (`jlong.planner.targets.default_budget_gib`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import MutableMapping


MEM_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"

# Kept free inside the pool by the default plan budget: allocator
# fragmentation between the separately allocated parameter and optimizer
# shards, the step's input batch on its way in, small runtime buffers.
POOL_RESERVE_GIB = 2.0


@dataclasses.dataclass(frozen=True)
class MemoryFraction:
    value: str  # what XLA_PYTHON_CLIENT_MEM_FRACTION holds for the run
    source: str  # where it came from, for the log line

    def describe(self) -> str:
        return f"{MEM_FRACTION_VARIABLE}={self.value} ({self.source})"


def apply_memory_fraction(configured: float, environ: MutableMapping[str, str] = os.environ) -> MemoryFraction:
    """Sets the pool share to `configured` (train.gpu_memory_fraction) in
    `environ`, unless the user exported one, which wins. Must run before jax
    starts its GPU backend; harmless where there is no GPU."""
    exported = environ.get(MEM_FRACTION_VARIABLE)
    if exported is not None:
        return MemoryFraction(exported, f"exported by you; train.gpu_memory_fraction={configured:g} not applied")
    environ[MEM_FRACTION_VARIABLE] = f"{configured:g}"
    return MemoryFraction(environ[MEM_FRACTION_VARIABLE], "from train.gpu_memory_fraction")
