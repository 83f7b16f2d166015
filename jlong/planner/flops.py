"""Model FLOPs per training token: the convention MFU and the executed /
model ratio are measured against.

A run that trains every weight costs the family's count
(`jlong.families.Family.flops_per_token`): 6 x the matmul parameters a
token meets (forward 2, backward 4: the input's gradient 2 and the weight's
2), plus causal attention. A LoRA run (`lora:`) forms no weight gradient
for its frozen base, so each frozen matmul parameter costs 4 (forward 2,
input gradient 2), the output projection included, and each adapter
parameter 6 (its own weight gradient is formed); attention has no weights
and costs what it costs without LoRA. The first layer's input gradient,
which a LoRA step could leave out (the embeddings are frozen), is counted,
as the family counts it. QLoRA's dequantization is not model work.
"""

from __future__ import annotations

import math

from jlong.config import Config
from jlong.families import family_of
from jlong.lora.targets import adapter_specs, lora_settings

# FLOPs per matmul parameter per token: forward, input gradient, weight gradient.
FORWARD, INPUT_GRADIENT, WEIGHT_GRADIENT = 2, 2, 2


def adapter_params_per_token(config: Config) -> int:
    """The adapters' parameters each token is multiplied by (0 without LoRA):
    rank x (inputs + outputs) of every adapted matrix of every layer."""
    lora = lora_settings(config.lora, config.model)
    if lora is None:
        return 0
    family = family_of(config.model)
    return sum(math.prod(spec.shape) * family.layers_with(config.model, spec)
               for spec in adapter_specs(config.model, lora).values())


def frozen_params_per_token(config: Config) -> float:
    """The matmul parameters each token meets that get no weight gradient:
    all of them under LoRA (`Family.matmul_params_per_token`), none otherwise."""
    if config.lora is None:
        return 0.0
    return family_of(config.model).matmul_params_per_token(config.model)


def model_flops_per_token(config: Config) -> float:
    """Model FLOPs per training token at `train.seq_len`, no recompute
    counted: the family's, less the frozen base's weight gradients, plus
    the adapters' forward and backward products."""
    model = config.model
    full = family_of(model).flops_per_token(model, config.train.seq_len)
    return (full - WEIGHT_GRADIENT * frozen_params_per_token(config)
            + (FORWARD + INPUT_GRADIENT + WEIGHT_GRADIENT) * adapter_params_per_token(config))
