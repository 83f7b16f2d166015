"""The one exception type that reaches the user as a one-line message."""


class JlongError(Exception):
    """A problem with the user's input (config, files, command line).

    The CLI prints it as one line on stderr and exits with status 2; it never
    shows a traceback. The message says what is wrong and how to fix it.
    """


class RunFailure(Exception):
    """A fault of the machine during a run (a checkpoint that cannot be
    written): one line on stderr and exit status 1, with the run's earlier
    checkpoints left as they were."""
