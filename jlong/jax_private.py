"""The names jlong takes from jax's private modules, in one place.

jlong runs on a range of jax releases (pyproject.toml: `jax>=0.10.2,<0.12`).
A few things it needs have no public API: cuDNN attention's inner
primitives, whether the backends have started, the cuDNN version the CUDA
plugin loads, a compilation-cache setting, the distributed service and the
settings of Mosaic GPU's interpreter.
Each is looked up here by its dotted name; a jax without it gives one line
naming the name and the installed jax version (a `JlongError`: exit status 2
on the command line), never an ImportError from deep inside a run.
"""

from __future__ import annotations

import importlib

from jlong.errors import JlongError

SUPPORTED_JAX = ">=0.10.2,<0.12"  # as pyproject.toml's dependency says


def private(module: str, name: str):
    """`module.name` from jax's private modules (`jax._src...`), or a one-line JlongError."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        import jax

        raise JlongError(
            f"jlong needs jax's private {module}.{name}, which jax {jax.__version__} does not have: "
            f"install a jax that jlong supports (pip install 'jax{SUPPORTED_JAX}')"
        ) from None
