"""Training checkpoints (orbax) and conversion to and from Hugging Face.

A checkpoint directory holds one sub-directory per saved step. orbax writes
each into a temporary directory and renames it when complete, so a crash at
any moment leaves the previous complete checkpoint as the newest one.
Each step holds `params`, `opt_state` (absent in converted checkpoints) and
`meta` (the step and the model architecture).
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp

from jlong.config import ModelConfig, model_config
from jlong.errors import JlongError


class Checkpoints:
    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state=None, *, model: ModelConfig, extra: dict | None = None):
        items = {
            "params": ocp.args.StandardSave(params),
            "meta": ocp.args.JsonSave({"step": step, "model": model.model_dump(), **(extra or {})}),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(opt_state)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        self.manager.wait_until_finished()

    def meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_params, abstract_opt_state=None):
        items = {"params": ocp.args.StandardRestore(abstract_params)}
        if abstract_opt_state is not None:
            items["opt_state"] = ocp.args.StandardRestore(abstract_opt_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        return restored["params"], restored.get("opt_state") if abstract_opt_state is not None else None

    def close(self):
        self.manager.close()


def convert(source: str | Path, destination: str | Path, *, param_dtype: str = "float32") -> None:
    """Hugging Face directory -> jlong checkpoint, or jlong checkpoint -> Hugging Face."""
    from flax import nnx

    from jlong.hf import from_hf, to_hf

    source, destination = Path(source), Path(destination)
    if not source.is_dir():
        raise JlongError(f"{str(source)!r} is not a directory")
    if (source / "config.json").is_file():
        model = from_hf(source, param_dtype=param_dtype)
        checkpoints = Checkpoints(destination)
        checkpoints.save(0, nnx.to_pure_dict(nnx.state(model)), model=model.config)
        checkpoints.close()
        return
    checkpoints = Checkpoints(source)
    step = checkpoints.latest_step()
    if step is None:
        raise JlongError(
            f"{str(source)!r} is neither a Hugging Face checkpoint (config.json) "
            "nor a jlong checkpoint directory"
        )
    saved_model = model_config(checkpoints.meta(step)["model"])
    from jlong.model.transformer import Transformer

    model = nnx.eval_shape(lambda: Transformer(saved_model, rngs=nnx.Rngs(0), param_dtype=param_dtype))
    graphdef, state = nnx.split(model)
    params, _ = checkpoints.restore(step, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, params)
    to_hf(nnx.merge(graphdef, state), destination)
    checkpoints.close()
