"""`train.init_from`: a run's step 1 from another run's weights, or from a
Hugging Face directory, with a fresh optimizer.

The source is a jlong checkpoint directory (its newest step, written on any
mesh) or a Hugging Face directory. It must hold the configured model's
weights: the fields that give the weights their shapes are compared before
anything is built, and the arrays' layout again as they are read. Anything
else may differ (the sequence length, RoPE, the mesh, the data): that is
what continuing a run at a longer context means. Once the run has
checkpoints of its own, it resumes from those and `init_from` is not read.
The training program reads the weights (`TrainProgram.load_initial_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jlong.checkpoint import Checkpoints, saved_steps, weights_kind
from jlong.config import Config, ModelConfig
from jlong.config.loading import WEIGHT_DEFINING_FIELDS
from jlong.errors import JlongError
from jlong.config.huggingface import read_hf_config

SETTING = "train.init_from"


@dataclass(frozen=True)
class InitialWeights:
    path: str
    kind: str  # "hf" or "jlong"
    step: int | None  # the jlong checkpoint's step read

    def describe(self) -> str:
        if self.kind == "hf":
            return f"the Hugging Face weights in {self.path}"
        return f"the weights of step {self.step} in {self.path}"


def check_init_from(config: Config) -> InitialWeights | None:
    """`train.init_from`, checked against the configured model (None when unset)."""
    path = config.train.init_from
    if path is None:
        return None
    if config.model.hf_path:
        raise JlongError(f"{SETTING} and model.hf_path both name starting weights: keep one")
    kind = weights_kind(path, SETTING)
    if kind == "hf":
        saved, step = read_hf_config(path), None
    else:
        step = saved_steps(path)[-1]
        checkpoints = Checkpoints(path)
        try:
            saved = checkpoints.meta(step)["model"]
        finally:
            checkpoints.close()
    _check_same_shapes(saved, config.model, path)
    return InitialWeights(str(path), kind, step)


def _check_same_shapes(saved: dict, model: ModelConfig, path: str) -> None:
    configured = model.model_dump()
    differing = [f"model.{key} {saved[key]!r} there, {configured[key]!r} here" for key in WEIGHT_DEFINING_FIELDS
                 if key in saved and saved[key] != configured[key]]
    if differing:
        raise JlongError(f"{SETTING} {str(path)!r} holds the weights of another model ({'; '.join(differing[:3])}): "
                         "configure the model it holds (its shapes), or start from other weights")
