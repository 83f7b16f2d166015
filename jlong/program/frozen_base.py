"""A LoRA run's parameters in two parts: the adapters, which train, and the
frozen base, which the step reads and hands back unchanged.

Both travel in the model's one parameter dict (what `nnx.to_pure_dict`
gives), the adapters as layer parameters beside their targets
(`{target}_lora_a`, `{target}_lora_b`). The step differentiates the
adapters alone, so no gradient of the base is ever formed; the optimizer's
state and a checkpoint hold the adapters alone. With `base_dtype: nf4` the
base's linear-layer matrices are held in 4 bits (`jlong.lora.nf4`).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

from jlong.families import family_of
from jlong.lora import nf4
from jlong.lora.targets import INPUT_AXES, LoraSettings
from jlong.parallel.placement import rest_spec

LAYERS = "layers"


class FrozenBase:
    def __init__(self, lora: LoraSettings, model, compute_dtype: str):
        self.lora, self.model, self.compute_dtype = lora, model, compute_dtype
        specs = family_of(model).layer_params(model)
        # QLoRA holds every linear-layer matrix of the layers in NF4, adapted or not (as bitsandbytes
        # quantizes every Linear); embeddings, norms, routers and a mixture's experts stay as they are.
        self.quantized = tuple(n for n in specs if n in INPUT_AXES) if lora.base_dtype == "nf4" else ()
        self.axes = {name: ("layers", *specs[name].axes) for name in self.quantized}

    def trainable(self, params: dict) -> dict:
        """The adapters: {"layers": {name: array}}."""
        return {LAYERS: {name: params[LAYERS][name] for name in self.lora.adapter_names}}

    def frozen(self, params: dict) -> dict:
        """Everything but the adapters."""
        layers = {name: w for name, w in params[LAYERS].items() if name not in self.lora.adapter_names}
        return {**params, LAYERS: layers}

    @staticmethod
    def join(frozen: dict, trainable: dict) -> dict:
        return {**frozen, LAYERS: {**frozen[LAYERS], **trainable[LAYERS]}}

    def decays(self, trainable: dict) -> dict:
        """AdamW decays every adapter (they are matrices)."""
        return jax.tree.map(lambda _: True, trainable)

    def quantize(self, params: dict) -> dict:
        """The base's linear-layer matrices in NF4 (unchanged without QLoRA)."""
        if not self.quantized:
            return params
        layers = dict(params[LAYERS])
        for name in self.quantized:
            layers[name] = nf4.quantize(layers[name], INPUT_AXES[name], self.compute_dtype)
        return {**params, LAYERS: layers}

    def quantized_shardings(self, shapes: dict, shardings: dict, mesh) -> dict:
        """`shardings` with each 4-bit matrix's codes and scales placed: each split
        over the devices along its first weight axis they divide, as a weight's would be."""
        if not self.quantized:
            return shardings
        layers = dict(shardings[LAYERS])
        for name in self.quantized:
            layers[name] = jax.tree.map(lambda leaf, axes=self.axes[name]: NamedSharding(
                mesh, rest_spec(leaf.shape, axes, mesh.size)), shapes[LAYERS][name])
        return {**shardings, LAYERS: layers}
