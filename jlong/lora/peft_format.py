"""PEFT's LoRA adapter directories, written from a run's adapters and read
back into them: `adapter_config.json` and `adapter_model.safetensors`, whose
tensors PEFT names `base_model.model.model.layers.{i}.{module}.lora_A.weight`
([r, in]) and `...lora_B.weight` ([out, r]), for the transformers model of
the family (`peft.PeftModel.from_pretrained` loads them onto it). Also the
adapters merged into their base's weights (`merged`), as PEFT's
`merge_and_unload` does.

jlong keeps a target w in its own layout [*inputs, *outputs] (`jlong.ops.
adapted`), a = [*inputs, r] and b = [r, *outputs]: PEFT's A and B
transposed and reshaped, as the family's Hugging Face table lays out w:
Hugging Face's [out, in] weight transposed and reshaped, its output columns
reordered where the table says so (`HFTensor.output_order`: the rotary
columns of DeepSeek's and GLM's q_proj, q_b_proj and kv_a_proj_with_mqa,
interleaved pairs in the checkpoint, halves in jlong), so B's rows are
reordered the same way; no table entry reorders the inputs, so A's columns
never are. b is kept unscaled, as PEFT's B: the layers scale it by alpha /
rank.

transformers 5 fused a Qwen3-MoE's experts into 3-D parameters, and PEFT,
to keep reading adapters trained on transformers 4, takes the names
`gate_proj`, `up_proj` and `down_proj` of a qwen3_moe model for those
experts: PEFT cannot adapt the MLP of such a model's dense layers
(`mlp_only_layers`). The same holds of DeepSeek-V2/V3's and GLM-4.7-Flash's
dense MLP and shared experts (`mlp.shared_experts.gate_proj`, ...): PEFT
maps the three names to the experts of every model transformers converts
as a Qwen2-MoE, whatever module path precedes them. `peft_caveat` says so
for a run that adapts them; its merged checkpoint (`jlong convert --merge`)
holds them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jlong.errors import JlongError
from jlong.families import family_of
from jlong.files import with_normal_permissions
from jlong.lora.targets import INPUT_AXES, LoraSettings, hf_modules

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"
# Where an image-text model's adapters (Qwen3.5's Qwen3_5ForConditionalGeneration) keep its text layers.
IMAGE_TEXT_PREFIX = "base_model.model.model.language_model.layers"
# PEFT settings whose adapters compute otherwise than x @ (w + alpha / r * A^T B^T): read by no run.
OTHER_KINDS = {"use_dora": "DoRA", "use_rslora": "rsLoRA (alpha / sqrt(r))", "fan_in_fan_out": "fan_in_fan_out",
               "rank_pattern": "a rank per module (rank_pattern)",
               "alpha_pattern": "an alpha per module (alpha_pattern)", "lora_bias": "LoRA biases",
               "target_parameters": "adapted parameters (target_parameters)"}
# Families whose MLP names PEFT on transformers 5 takes for the experts' fused parameters (see the docstring).
EXPERT_NAMES = {"qwen3_moe": ("w_gate", "w_up", "w_down"),
                **{family: ("w_gate", "w_up", "w_down", "shared_gate", "shared_up", "shared_down")
                   for family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")}}


def _layers_of(model, name: str) -> list[int]:
    """The layer numbers a layer parameter is stacked over, in stack order."""
    family = family_of(model)
    spec = family.layer_params(model)[name]
    kinds = family.layer_types(model)
    return [i for i in range(model.num_hidden_layers) if spec.layer_type in (None, kinds[i])]


def _shapes(model, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    shape = family_of(model).layer_params(model)[name].shape
    return shape[:INPUT_AXES[name]], shape[INPUT_AXES[name]:]


def adapter_shapes(model, lora: LoraSettings) -> dict[str, tuple[int, ...]]:
    """Each adapter's stacked shape: `{target}_lora_a` [layers, *inputs, r], `_lora_b` [layers, r, *outputs]."""
    shapes = {}
    for name in lora.targets:
        inputs, outputs = _shapes(model, name)
        count = len(_layers_of(model, name))
        shapes[name + "_lora_a"] = (count, *inputs, lora.rank)
        shapes[name + "_lora_b"] = (count, lora.rank, *outputs)
    return shapes


def peft_tensors(adapters: dict[str, np.ndarray], model, lora: LoraSettings) -> dict[str, np.ndarray]:
    """A run's adapters (`{target}_lora_a` [layers, *inputs, r], `_lora_b`
    [layers, r, *outputs]) as PEFT's tensors, float32."""
    modules, tensors = hf_modules(model), {}
    for name in lora.targets:
        a, b = np.asarray(adapters[name + "_lora_a"], np.float32), np.asarray(adapters[name + "_lora_b"], np.float32)
        order = _output_order(model, name)
        for stacked, layer in enumerate(_layers_of(model, name)):
            where = f"{PREFIX}.{layer}.{modules[name]}"
            tensors[f"{where}.lora_A.weight"] = np.ascontiguousarray(a[stacked].reshape(-1, lora.rank).T)
            tensors[f"{where}.lora_B.weight"] = np.ascontiguousarray(b[stacked].reshape(lora.rank, -1)[:, order].T)
    return tensors


def _output_order(model, name: str) -> np.ndarray | slice:
    """Which of jlong's (flattened) output columns each of Hugging Face's output rows is."""
    order = family_of(model).hf_layer_tensors(model)[name].output_order
    return slice(None) if order is None else np.asarray(order)


def peft_config(model, lora: LoraSettings, base: str | None) -> dict:
    """adapter_config.json: the modules by their short names (each names one kind of module)."""
    modules = hf_modules(model)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({modules[name].rsplit(".", 1)[-1] for name in lora.targets}),
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
    }


def peft_caveat(model, lora: LoraSettings) -> str | None:
    """A line on what PEFT will not load of these adapters (None: it loads them all)."""
    lost = [name for name in EXPERT_NAMES.get(model.family, ()) if name in lora.targets]
    if not lost:
        return None
    names = ", ".join(dict.fromkeys(hf_modules(model)[name].rsplit(".", 1)[-1] for name in lost))
    where = " and ".join(dict.fromkeys("the shared experts" if name.startswith("shared_") else "the dense layers' MLP"
                                       for name in lost))
    return (f"note: PEFT on transformers 5 takes {names} of a {model.family} model for its experts' fused "
            f"parameters, so it leaves out these adapters of {where}; a checkpoint converted with "
            f"--merge holds them")


def write_adapters(directory: str | Path, adapters: dict[str, np.ndarray], model, lora: LoraSettings,
                   base: str | None, dtype: str = "float32") -> list[Path]:
    """A PEFT adapter directory from a run's adapters (in `dtype`); `base` names the base model it adapts."""
    import ml_dtypes
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {key: value.astype(kind) for key, value in peft_tensors(adapters, model, lora).items()}
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    with_normal_permissions(directory / WEIGHTS_FILE)  # safetensors writes it readable by its owner only
    (directory / CONFIG_FILE).write_text(json.dumps(peft_config(model, lora, base), indent=2) + "\n")
    return sorted(directory.iterdir())


def read_adapters(directory: str | Path, program) -> dict:
    """A PEFT adapter directory as the run's adapters ({"layers": {name: array}},
    float32), checked against its `lora` settings: rank, alpha and targets."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    lora, model = program.lora, program.config.model
    directory = Path(directory)
    where = f"lora.init_from {str(directory)!r}"
    if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise JlongError(f"{where} is not a PEFT adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        saved = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as err:
        raise JlongError(f"{where}: {CONFIG_FILE} cannot be read ({err})") from None
    if not isinstance(saved, dict):
        raise JlongError(f"{where}: {CONFIG_FILE} is not a PEFT config")
    if saved.get("peft_type", "LORA") != "LORA":
        raise JlongError(f"{where} holds {saved.get('peft_type')} adapters; a run reads PEFT's plain LoRA")
    other = [kind for key, kind in OTHER_KINDS.items() if saved.get(key)]
    if other:
        raise JlongError(f"{where} holds adapters with {other[0]}; a run reads PEFT's plain LoRA")
    if (saved.get("r"), float(saved.get("lora_alpha", 8))) != (lora.rank, lora.alpha):
        raise JlongError(f"{where} has rank {saved.get('r')} and alpha {saved.get('lora_alpha', 8):g}; this run "
                         f"configures rank {lora.rank} and alpha {lora.alpha:g}: set lora.rank and lora.alpha to its")
    try:
        tensors = load_file(str(directory / WEIGHTS_FILE))
    except (OSError, SafetensorError) as err:
        raise JlongError(f"{where}: {WEIGHTS_FILE} cannot be read ({err})") from None
    tensors = {key.replace(".default.", ".").replace(IMAGE_TEXT_PREFIX + ".", PREFIX + "."): value
               for key, value in tensors.items()}
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
        order = _output_order(model, name)
        back = order if isinstance(order, slice) else np.argsort(order)
        layers[name + "_lora_b"] = np.stack(
            [tensors[f"{s}.lora_B.weight"].astype(np.float32).T[:, back].reshape(lora.rank, *outputs)
             for s in stacked])
    return {"layers": layers}


def merged(layers: dict[str, np.ndarray], adapters: dict[str, np.ndarray], lora: LoraSettings) -> dict:
    """A base's layer parameters with each target w replaced by w + alpha / r * a @ b (computed in float32,
    in w's dtype), as PEFT's `merge_and_unload`; the adapters dropped."""
    layers = {name: w for name, w in layers.items() if not name.endswith(("_lora_a", "_lora_b"))}
    for name in lora.targets:
        w = np.asarray(layers[name])
        a = np.asarray(adapters[name + "_lora_a"], np.float32)
        b = np.asarray(adapters[name + "_lora_b"], np.float32)
        count = w.shape[0]
        update = np.matmul(a.reshape(count, -1, lora.rank), b.reshape(count, lora.rank, -1))
        layers[name] = (w.astype(np.float32) + np.float32(lora.scale) * update.reshape(w.shape)).astype(w.dtype)
    return layers


def _zero_adapters(model, lora: LoraSettings) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape, np.float32) for name, shape in adapter_shapes(model, lora).items()}
