"""Stopping on the cluster's warning: SIGTERM or SIGUSR1 asks a run to stop.

SLURM (`--signal`, preemption) and Kubernetes send a signal some minutes
before they kill. The handler only records which signal came; the loop asks
`agreed()` between steps, so the step under way finishes and its
checkpoint is written. In a multi-process run the signal may reach one
process only: every process contributes what it saw to one all-gather, so
all stop after the same step. Further signals (during the final save) are
recorded and change nothing.
"""

from __future__ import annotations

import signal
import threading

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequests:
    """The stop signals received by this process, from `install()` until `uninstall()`."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self._previous: dict = {}

    @classmethod
    def installed(cls) -> StopRequests:
        """Handlers for the stop signals, when this is the main thread (only it may install them)."""
        requests = cls()
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                requests._previous[signum] = signal.signal(signum, requests._record)
        return requests

    def _record(self, signum, _frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def agreed(self) -> signal.Signals | None:
        """The signal that stops the run now, the same on every process (None: go on).
        Every process must call this at the same point of the run."""
        import jax

        if jax.process_count() == 1:
            return self.received
        from jax.experimental import multihost_utils

        seen = np.int32(self.received.value if self.received else 0)
        stopping = int(np.max(multihost_utils.process_allgather(seen)))
        return signal.Signals(stopping) if stopping else None
