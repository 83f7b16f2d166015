"""PEFT's LoRA adapter directories, written from a run's adapters and read
back into them: `adapter_config.json` and `adapter_model.safetensors`, whose
tensors PEFT names `base_model.model.model.layers.{i}.{module}.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]), for the transformers model of
the family (`peft.PeftModel.from_pretrained` loads them onto it).

jlong keeps a target w in its own layout [*inputs, *outputs] (`jlong.lora.
adapted`), a = [*inputs, r] and b = [r, *outputs]: PEFT's A and B
transposed and reshaped, as the family's Hugging Face table lays out w.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from jlong.errors import JlongError
from jlong.families import family_of
from jlong.lora.targets import INPUT_AXES, LoraSettings, hf_modules

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"


def _layers_of(model, name: str) -> list[int]:
    """The layer numbers a layer parameter is stacked over, in stack order."""
    family = family_of(model)
    spec = family.layer_params(model)[name]
    kinds = family.layer_types(model)
    return [i for i in range(model.num_hidden_layers) if spec.layer_type in (None, kinds[i])]


def _shapes(model, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = family_of(model).layer_params(model)[name].shape
    return shape[:INPUT_AXES[name]], shape[INPUT_AXES[name]:]


def peft_tensors(adapters: dict[str, np.ndarray], model, lora: LoraSettings) -> dict[str, np.ndarray]:
    """A run's adapters (`{target}_lora_a` [layers, *inputs, r], `_lora_b`
    [layers, r, *outputs]) as PEFT's tensors, float32."""
    modules, tensors = hf_modules(model), {}
    for name in lora.targets:
        a, b = np.asarray(adapters[name + "_lora_a"], np.float32), np.asarray(adapters[name + "_lora_b"], np.float32)
        for stacked, layer in enumerate(_layers_of(model, name)):
            where = f"{PREFIX}.{layer}.{modules[name]}"
            tensors[f"{where}.lora_A.weight"] = np.ascontiguousarray(a[stacked].reshape(-1, lora.rank).T)
            tensors[f"{where}.lora_B.weight"] = np.ascontiguousarray(b[stacked].reshape(lora.rank, -1).T)
    return tensors


def peft_config(model, lora: LoraSettings, base: str | None) -> dict:
    """adapter_config.json: the modules by their short names (each names one kind of module)."""
    modules = hf_modules(model)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({modules[name].rsplit(".", 1)[-1] for name in lora.targets}),
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
    }


def write_adapters(directory: str | Path, adapters: dict[str, np.ndarray], model, lora: LoraSettings,
                   base: str | None) -> list[Path]:
    """A PEFT adapter directory from a run's adapters; `base` names the base model it adapts."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_FILE).write_text(json.dumps(peft_config(model, lora, base), indent=2) + "\n")
    save_file(peft_tensors(adapters, model, lora), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return sorted(directory.iterdir())


def read_adapters(directory: str | Path, program) -> dict:
    """A PEFT adapter directory as the run's adapters ({"layers": {name: array}},
    float32), checked against its `lora` settings: rank, alpha and targets."""
    from safetensors.numpy import load_file

    lora, model = program.lora, program.config.model
    directory = Path(directory)
    where = f"lora.init_from {str(directory)!r}"
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise JlongError(f"{where} is not a PEFT adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    saved = json.loads((directory / CONFIG_FILE).read_text())
    if saved.get("peft_type", "LORA") != "LORA" or saved.get("use_dora") or saved.get("use_rslora"):
        raise JlongError(f"{where} holds adapters of another kind (PEFT's plain LoRA is read: no DoRA, no rsLoRA)")
    if (saved.get("r"), float(saved.get("lora_alpha", 0))) != (lora.rank, lora.alpha):
        raise JlongError(f"{where} has rank {saved.get('r')} and alpha {saved.get('lora_alpha')}; this run "
                         f"configures rank {lora.rank} and alpha {lora.alpha:g}: set lora.rank and lora.alpha to its")
    tensors = load_file(str(directory / WEIGHTS_FILE))
    tensors = {key.replace(".default.", "."): value for key, value in tensors.items()}
    expected = peft_tensors(_zero_adapters(model, lora), model, lora)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        name, what = (missing[0], "lacks") if missing else (extra[0], "has a tensor this run does not adapt:")
        raise JlongError(f"{where} {what} {name} (lora.targets must name the modules it adapts)")
    for key, value in expected.items():
        if tensors[key].shape != value.shape:
            raise JlongError(f"{where}: {key} is {list(tensors[key].shape)}, this model's is {list(value.shape)}")
    modules, layers = hf_modules(model), {}
    for name in lora.targets:
        inputs, outputs = _shapes(model, name)
        stacked = [f"{PREFIX}.{i}.{modules[name]}" for i in _layers_of(model, name)]
        layers[name + "_lora_a"] = np.stack(
            [tensors[f"{s}.lora_A.weight"].astype(np.float32).T.reshape(*inputs, lora.rank) for s in stacked])
        layers[name + "_lora_b"] = np.stack(
            [tensors[f"{s}.lora_B.weight"].astype(np.float32).T.reshape(lora.rank, *outputs) for s in stacked])
    return {"layers": layers}


def _zero_adapters(model, lora: LoraSettings) -> dict[str, np.ndarray]:
    adapters = {}
    for name in lora.targets:
        inputs, outputs = _shapes(model, name)
        count = len(_layers_of(model, name))
        adapters[name + "_lora_a"] = np.zeros((count, math.prod(inputs), lora.rank), np.float32)
        adapters[name + "_lora_b"] = np.zeros((count, lora.rank, math.prod(outputs)), np.float32)
    return adapters
