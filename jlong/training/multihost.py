"""Several processes, one training run: `jax.distributed` set-up.

Configured by `--coordinator/--num-processes/--process-id`, or by the
environment variables JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID, or (under SLURM) by jax's own cluster detection.
"""

from __future__ import annotations

import os
import time

from jlong.errors import JlongError
from jlong.jax_private import private


def process_count_requested(num_processes: int | None) -> int:
    if num_processes is not None:
        return num_processes
    if "JAX_NUM_PROCESSES" in os.environ:
        return int(os.environ["JAX_NUM_PROCESSES"])
    if "SLURM_NTASKS" in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_NTASKS"])
    return 1


def initialize_distributed(coordinator: str | None, num_processes: int | None, process_id: int | None) -> None:
    import jax

    count = process_count_requested(num_processes)
    if count <= 1:
        return
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if process_id is None and "JAX_PROCESS_ID" in os.environ:
        process_id = int(os.environ["JAX_PROCESS_ID"])
    # CPU processes need a collectives backend; accelerators ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jlong never asks for preemption sync points; the service's long-poll
    # RPCs would only be left pending in the coordinator at exit.
    jax.config.update("jax_enable_preemption_service", False)
    if coordinator is None and "SLURM_PROCID" not in os.environ:
        raise JlongError("multi-process training needs coordinator host:port (or JAX_COORDINATOR_ADDRESS)",
                         "coordinator")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=process_id)


# How long the coordinator keeps its service up after the shutdown barrier,
# so that the other processes' last RPCs (heartbeats, error polls being
# cancelled) finish before it stops: a gRPC server destroyed with requests
# still queued aborts the process (seen once in CI, not reproducible here).
_SERVICE_DRAIN_SECONDS = 2.0


def shutdown_distributed() -> None:
    """Leave a multi-process run in a fixed order after a successful run.

    Every client passes jax's shutdown barrier; then the coordinator waits
    for the stragglers' RPCs to drain before stopping its service.
    """
    import jax

    state = private("jax._src.distributed", "global_state")  # the service is not reachable through the public API
    if state.client is None:
        return
    service, state.service = state.service, None
    jax.distributed.shutdown()
    if service is not None:
        time.sleep(_SERVICE_DRAIN_SECONDS)
        service.shutdown()
