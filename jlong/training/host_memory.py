"""Host memory checked before the first step.

The plan's host budget is only a plan: a node whose free memory is less than
what the step keeps in host memory (offloaded activations, an offloaded
optimizer's state) would be killed by the kernel's out-of-memory killer hours
into the run. On a GPU the loop compares the compiled step's host bytes on
this node with /proc/meminfo's MemAvailable before it starts.
"""

from __future__ import annotations

from pathlib import Path

from jlong.errors import JlongError
from jlong.planner.targets import GIB

MEMINFO = Path("/proc/meminfo")


def available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where there is no such file (not Linux)."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name == "MemAvailable":
            return int(value.split()[0]) * 1024  # the kernel writes kB, meaning KiB
    return None


def check_host_memory(needed_per_node: int, available: int | None) -> None:
    """Stops the run, in one line, when this node cannot hold what the step keeps in host memory."""
    if available is None or needed_per_node <= available:
        return
    raise JlongError(
        f"the train step keeps {needed_per_node / GIB:,.1f} GiB in host memory on this node (offloaded "
        f"activations and optimizer state), but {available / GIB:,.1f} GiB is available (MemAvailable in "
        "/proc/meminfo): free host memory, offload less (memory.remat, memory.optimizer_offload), spread the "
        "run over more nodes, or set train.check_host_memory=false to start anyway"
    )
