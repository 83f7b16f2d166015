"""A run's progress on stderr: a bar on a terminal; in a log file (SLURM's
output, a pipe) one plain line every few percent of the steps or every
minute, instead of a bar's carriage returns."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_EVERY_PERCENT = 5
LINE_EVERY_SECONDS = 60.0


class Progress:
    def __init__(self, *, first: int, last: int, enabled: bool, stream=None):
        """Steps `first` + 1 ... `last` are to run; `enabled` is False on all processes but the first."""
        self.stream = stream or sys.stderr
        self.first, self.last, self.enabled = first, last, enabled
        self.as_lines = enabled and not _is_terminal(self.stream)
        self.bar = None if self.as_lines else tqdm(total=last, initial=first, disable=not enabled, desc="train",
                                                   unit="step", file=self.stream)
        self.began = self.said_at = time.monotonic()
        self.said_percent = 100 * first // last

    def advance(self, step: int, values: dict[str, str]) -> None:
        """Step `step` is done; `values` (name -> formatted) describe it."""
        if self.bar is not None:
            self.bar.set_postfix(values, refresh=False)
            self.bar.update(1)
            return
        if not self.as_lines:
            return
        now = time.monotonic()
        percent = 100 * step // self.last
        if step == self.last or percent >= self.said_percent + LINE_EVERY_PERCENT or \
                now - self.said_at >= LINE_EVERY_SECONDS:
            self.said_at, self.said_percent = now, percent
            print(self._line(step, now, values), file=self.stream, flush=True)

    def _line(self, step: int, now: float, values: dict[str, str]) -> str:
        done = step - self.first
        elapsed = now - self.began
        left = elapsed / done * (self.last - step)
        timing = f"elapsed {_duration(elapsed)}" + (f", about {_duration(left)} left" if step < self.last else "")
        parts = [f"train: step {step}/{self.last} ({100 * step / self.last:.0f}%)",
                 *(f"{name} {value}" for name, value in values.items()), timing]
        return "  ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    """'45 s', '12 min 5 s', '3 h 20 min'."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"
