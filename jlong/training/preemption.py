"""Stopping a run gracefully: SIGTERM, SIGUSR1 or Ctrl-C (SIGINT) asks it to stop.

SLURM (`--signal`, preemption) and Kubernetes send a signal some minutes
before they kill; a person presses Ctrl-C. The handler records which signal
came and says, on stderr, what happens next; the loop asks `agreed()`
between steps, so the step under way finishes and its checkpoint is
written. In a multi-process run the signal may reach one process only:
every process contributes what it saw to one all-gather, so all stop after
the same step. Further SIGTERMs and SIGUSR1s (during the final save) change
nothing; a second Ctrl-C quits at once, without saving: after the first,
SIGINT is given back its default action, which ends the process even in
the middle of a compiled step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopRequests:
    """The stop signals received by this process, from `install()` until `uninstall()`."""

    def __init__(self):
        self.received: signal.Signals | None = None
        self.stopped_by: signal.Signals | None = None  # the signal the run stopped on, once agreed
        self._previous: dict = {}
        self._under_way: tuple[int, float, float | None] | None = None  # step, its start, its expected seconds
        self._stderr: int | None = None  # a descriptor of the stderr the run started with

    @classmethod
    def installed(cls) -> StopRequests:
        """Handlers for the stop signals, when this is the main thread (only it may install them)."""
        requests = cls()
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                requests._previous[signum] = signal.signal(signum, requests._record)
            # Where stderr goes now: native-library noise is silenced by pointing descriptor 2 elsewhere at times.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                requests._stderr = os.dup(sys.stderr.fileno())
        return requests

    def step_started(self, step: int, expected_seconds: float | None) -> None:
        """The loop is running `step`, expected to take that long: what a stop line names."""
        self._under_way = (step, time.monotonic(), expected_seconds)

    def _record(self, signum, _frame) -> None:
        signum = signal.Signals(signum)
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
        if self.received is None:
            self.received = signum
            self._tell(self._what_happens_now(signum))

    def _what_happens_now(self, signum: signal.Signals) -> str:
        name = "Ctrl-C" if signum == signal.SIGINT else signum.name
        again = "; Ctrl-C again quits at once without saving" if signum == signal.SIGINT else ""
        if self._under_way is None:
            return f"jlong: {name}: stopping before the first step{again}"
        step, began, expected = self._under_way
        left = expected - (time.monotonic() - began) if expected else None
        eta = f" (about {left:,.0f} s left)" if left is not None and left >= 2 else ""
        return f"jlong: {name}: stopping after step {step}{eta}, then saving its checkpoint{again}"

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if self._stderr is not None:
            os.close(self._stderr)
            self._stderr = None

    def _tell(self, line: str) -> None:
        """One line on stderr, written straight to a descriptor: a signal handler
        must not re-enter Python's buffered stream (the progress bar may be
        writing to it)."""
        if self._stderr is None:
            return
        start = "\n" if os.isatty(self._stderr) else ""
        with contextlib.suppress(OSError):
            os.write(self._stderr, f"{start}{line}\n".encode())

    def agreed(self) -> signal.Signals | None:
        """The signal that stops the run now, the same on every process (None: go on).
        Every process must call this at the same point of the run."""
        import jax

        if jax.process_count() == 1:
            self.stopped_by = self.received
        else:
            from jax.experimental import multihost_utils

            seen = np.int32(self.received.value if self.received else 0)
            stopping = int(np.max(multihost_utils.process_allgather(seen)))
            self.stopped_by = signal.Signals(stopping) if stopping else None
        return self.stopped_by
