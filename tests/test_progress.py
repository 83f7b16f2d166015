"""What a run shows while it trains: a bar on a terminal, plain lines in a log."""

import io

from jlong.training.progress import LINE_EVERY_PERCENT, Progress
import pytest

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_in_a_log_progress_is_a_plain_line_every_few_percent():
    log = io.StringIO()
    progress = Progress(first=0, last=200, enabled=True, stream=log)
    for step in range(1, 201):
        progress.advance(step, {"loss": f"{1 / step:.4f}"})
    progress.close()
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) == 100 // LINE_EVERY_PERCENT  # 5%, 10%, ..., 100%
    assert lines[0].startswith("train: step 10/200 (5%)  loss 0.1000  elapsed ") and lines[0].endswith(" left")
    assert lines[-1].startswith("train: step 200/200 (100%)  loss 0.0050  elapsed ") and "left" not in lines[-1]


def test_a_resumed_run_counts_from_its_checkpoint_and_other_processes_are_quiet():
    log = io.StringIO()
    progress = Progress(first=150, last=200, enabled=True, stream=log)
    for step in range(151, 201):
        progress.advance(step, {})
    assert log.getvalue().splitlines()[0].startswith("train: step 160/200 (80%)")
    quiet = io.StringIO()
    other = Progress(first=0, last=10, enabled=False, stream=quiet)
    for step in range(1, 11):
        other.advance(step, {"loss": "1"})
    other.close()
    assert quiet.getvalue() == ""


def test_on_a_terminal_progress_is_a_bar():
    terminal = _Terminal()
    progress = Progress(first=0, last=4, enabled=True, stream=terminal)
    for step in range(1, 5):
        progress.advance(step, {"loss": "2.5000"})
    progress.close()
    assert "\r" in terminal.getvalue() and "4/4" in terminal.getvalue() and "loss=2.5000" in terminal.getvalue()
