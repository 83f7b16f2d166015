"""`rl.export_every`: the policy's weights as a Hugging Face checkpoint in
`rl.export_dir`, for the inference engine that writes `rl.rollouts` (vLLM,
SGLang) to reload, as decoupled RL stacks run.

The export replaces the previous one whole: it is written beside the
directory under a temporary name, then renamed into place, so an engine
never reads half of it. A LoRA run's adapters are merged into its base (read
again from model.hf_path, as `jlong convert --merge` does).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jlong.errors import JlongError


def export_weights(program, params: dict, directory: str | Path) -> Path:
    """Writes the weights of `params` (as `program` holds them between steps) to `directory`; every process
    calls it, the first writes."""
    from jlong.hf import load_hf_params, to_hf
    from jlong.lora import peft_format
    from jlong.model.transformer import Transformer

    config = program.config
    directory = Path(directory)
    gathered = jax.tree.map(np.asarray, multihost_utils.process_allgather(program.saved(params), tiled=True))
    if jax.process_index() != 0:
        return directory
    model = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0), param_dtype=config.train.param_dtype))
    graphdef, state = nnx.split(model)
    if program.lora:
        if not config.model.hf_path:
            raise JlongError("rl.export_every of a LoRA run merges its adapters into model.hf_path, which is unset")
        here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=here), nnx.to_pure_dict(state))
        weights = jax.tree.map(np.asarray, load_hf_params(config.model.hf_path, config.model, shapes))
        weights["layers"] = peft_format.merged(weights["layers"], gathered["layers"], program.lora)
    else:
        weights = gathered
    nnx.replace_by_pure_dict(state, weights)
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    to_hf(nnx.merge(graphdef, state), partial)
    previous = directory.with_name(directory.name + ".previous")
    if directory.exists():
        shutil.rmtree(previous, ignore_errors=True)
        directory.rename(previous)
    partial.rename(directory)
    shutil.rmtree(previous, ignore_errors=True)
    return directory
