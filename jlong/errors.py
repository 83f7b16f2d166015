"""The one exception type that reaches the user as a one-line message."""

import re


class JlongError(Exception):
    """A problem with the user's input (config, files, command line).

    The CLI prints it as one line on stderr and exits with status 2; it never
    shows a traceback. The message says what is wrong and how to fix it.

    A problem with a function's argument names the argument as the Python
    API spells it (`option`, e.g. "budget_gib"); the command line writes
    its flag (--budget-gib) in its place (`for_command_line`).
    """

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option

    def for_command_line(self) -> str:
        message = str(self)
        if self.option:
            flag = "--" + self.option.replace("_", "-")
            message = re.sub(rf"(?<![\w.-]){re.escape(self.option)}(?![\w-])", flag, message)
        return message


class RunFailure(Exception):
    """A fault of the machine during a run (a checkpoint that cannot be
    written): one line on stderr and exit status 1, with the run's earlier
    checkpoints left as they were."""
