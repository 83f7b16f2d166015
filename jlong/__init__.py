"""jlong: long-context training of Llama- and Qwen-style transformers in JAX.

For scripts and notebooks (docs/python.md): `jlong.load_config`,
`jlong.plan`, `jlong.maxlen`, `jlong.train`, `jlong.evaluate`,
`jlong.generate`; models:
`jlong.from_hf`, `jlong.to_hf`, `jlong.Transformer`; the program the loop
runs and the planner compiles: `jlong.TrainProgram`.

The public names load on first use, so `import jlong.errors` or the command
line's start-up does not import jax before it has set jax up. No
subpackage is named like a function here, so importing one never hides it.
"""

import importlib

_EXPORTS = {
    "Config": "jlong.config",
    "ModelConfig": "jlong.config",
    "load_config": "jlong.api",  # with the families and methods a config names registered
    "JlongError": "jlong.errors",
    "Plan": "jlong.api",
    "plan": "jlong.api",
    "maxlen": "jlong.api",
    "train": "jlong.api",
    "evaluate": "jlong.api",
    "generate": "jlong.api",
    "from_hf": "jlong.hf",
    "to_hf": "jlong.hf",
    "ForwardOptions": "jlong.model.transformer",
    "Transformer": "jlong.model.transformer",
    "TrainProgram": "jlong.program.train_program",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jlong' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__():
    return sorted([*globals(), *_EXPORTS])
