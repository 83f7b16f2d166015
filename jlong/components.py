"""Every built-in model family and sequence-parallel method, imported so that
each registers itself with the config's registry (`jlong.config.registry`):
the schema reads a family's defaults and calls the family's and the method's
checks through it. The command line and the Python API import this before
they read a config."""

import jlong.attention.methods  # noqa: F401
import jlong.families  # noqa: F401
