"""Hugging Face checkpoints: config.json + *.safetensors <-> jlong models.

config.json is read and written by `jlong.hf_config`; each parameter's
tensor name and layout is its family's (`jlong.families`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding
from safetensors import safe_open
from safetensors.flax import save_file

from jlong.config import ModelConfig, model_config
from jlong.config.huggingface import read_hf_config
from jlong.errors import JlongError
from jlong.files import with_normal_permissions
from jlong.families import family_of
from jlong.families.base import HFTensor
from jlong.hf_config import hf_config_dict
from jlong.model.transformer import ForwardOptions, Transformer
from jlong.moe import mxfp4

SHARD_BYTES = 4 << 30  # safetensors file size cap when writing


# --------------------------------------------------------------------------
# config.json


def model_config_from_hf(path: str | Path) -> ModelConfig:
    return model_config({**read_hf_config(path), "hf_path": str(path)})


# --------------------------------------------------------------------------
# Tensor names and layouts


@dataclasses.dataclass(frozen=True)
class Stored:
    """Where one jlong parameter is in a Hugging Face checkpoint: for each
    entry of its stack (each layer; one entry for a parameter outside the
    layers), the tensors it is made of, and their layout."""

    entries: list[list[str]]
    tensor: HFTensor

    @property
    def names(self) -> list[str]:
        return [name for entry in self.entries for name in entry]

    def to_jlong(self, read: Callable[[str], np.ndarray], entry: list[str]) -> np.ndarray:
        """One entry in jlong's layout from its tensors (`read` by name)."""
        if self.tensor.parts:
            return np.stack([self.tensor.to_jlong(read(name)) for name in entry])
        return self.tensor.to_jlong(read(entry[0]))

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        """One entry's tensors in Hugging Face's layout."""
        if self.tensor.parts:
            return [self.tensor.to_hf(part) for part in value]
        return [self.tensor.to_hf(value)]


def hf_tensor_names(config: ModelConfig) -> dict[tuple[str, ...], Stored]:
    """Each jlong parameter (its path in the parameter dict) -> its tensors
    in a Hugging Face checkpoint (`Stored`)."""
    family = family_of(config)
    names = {(name,): Stored([t.part_names()], t) for name, t in family.hf_outer_tensors(config).items()}
    specs, kinds = family.layer_params(config), family.layer_types(config)
    for name, t in family.hf_layer_tensors(config).items():
        kind = specs[name].layer_type  # a parameter of one layer type's layers is stacked over those alone
        layers = [t.part_names(f"model.layers.{i}.") for i in range(config.num_hidden_layers)
                  if kind in (None, kinds[i])]
        names[("layers", name)] = Stored(layers, t)
    return names


def _expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    family = family_of(config)
    specs = {("layers", n): s for n, s in family.layer_params(config).items()}
    specs.update({(n,): s for n, s in family.outer_params(config).items()})
    shapes = {}
    for keys, stored in hf_tensor_names(config).items():
        shape = specs[keys].shape[1:] if stored.tensor.parts else specs[keys].shape
        hf_shape = jax.eval_shape(stored.tensor.to_hf, jax.ShapeDtypeStruct(shape, np.float32)).shape
        shapes.update({name: hf_shape for name in stored.names})
    return shapes


# --------------------------------------------------------------------------
# Reading


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / file for name, file in weight_map.items()}
        missing = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if missing:
            raise JlongError(f"{path}: the safetensors index names missing files: {', '.join(missing)}")
        return files
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise JlongError(f"Hugging Face checkpoint {str(path)!r} has no *.safetensors files")
    files = {}
    for file in found:
        with safe_open(file, framework="numpy") as f:
            files.update({name: file for name in f.keys()})
    return files


def _stored_as(name: str) -> list[str]:
    """Where a text model's tensor can be stored: under its own name, or in an
    image-text checkpoint's language model (transformers 4 saved it as
    `language_model.model...`, transformers 5 as `model.language_model...`)."""
    names = [name, f"language_model.{name}"]
    if name.startswith("model."):
        names.append(f"model.language_model.{name.removeprefix('model.')}")
    return names


class _Checkpoint:
    """A checkpoint's safetensors files, checked against the config's shapes
    before anything is read, and read one tensor at a time. A tensor stored
    in MXFP4 (`NAME_blocks` and `NAME_scales`, as OpenAI publishes GPT-OSS's
    experts) is read dequantized (`jlong.moe.mxfp4`)."""

    def __init__(self, path: Path, config: ModelConfig):
        self.files = _safetensors_files(path)
        expected = _expected_hf_shapes(config)
        self.stored = {name: self._find(name) for name in expected}
        self.quantized = {name: (self._find(name + mxfp4.BLOCKS), self._find(name + mxfp4.SCALES))
                          for name, stored in self.stored.items() if stored is None}
        self.quantized = {name: parts for name, parts in self.quantized.items() if None not in parts}
        missing = [name for name, stored in self.stored.items() if stored is None and name not in self.quantized]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise JlongError(f"{path}: checkpoint lacks tensors {', '.join(missing[:3])}{more}")
        for name, shape in expected.items():
            if name in self.quantized:
                blocks, scales = self.quantized[name]
                stored = blocks.removesuffix(mxfp4.BLOCKS)
                found = mxfp4.dequantized_shape(self._shape(blocks), self._shape(scales), stored)
            else:
                stored = self.stored[name]
                found = self._shape(stored)
            if found != shape:
                raise JlongError(
                    f"{self.files[self.stored[name] or self.quantized[name][0]].name}: tensor {stored} has shape "
                    f"{found}, but config.json implies {shape}"
                )

    def _find(self, name: str) -> str | None:
        return next((s for s in _stored_as(name) if s in self.files), None)

    def _shape(self, stored: str) -> tuple[int, ...]:
        with safe_open(self.files[stored], framework="numpy") as f:
            return tuple(f.get_slice(stored).get_shape())

    def _read(self, stored: str) -> np.ndarray:
        with safe_open(self.files[stored], framework="numpy") as f:
            return f.get_tensor(stored)

    def tensor(self, name: str) -> np.ndarray:
        if name in self.quantized:
            return mxfp4.dequantize(*map(self._read, self.quantized[name]))
        return self._read(self.stored[name])


def load_hf_params(path: str | Path, config: ModelConfig, abstract_params: dict) -> dict:
    """A checkpoint's weights as jlong's parameter dict, each array built in
    the sharding and dtype of its `abstract_params` entry (ShapeDtypeStructs
    with shardings).

    Nothing passes whole through one device, and the host holds one HF tensor
    at a time beside the shards being filled: each tensor is read, laid out,
    cut into the pieces the devices hold and dropped."""
    checkpoint = _Checkpoint(Path(path), config)
    params: dict = {}
    for keys, stored in hf_tensor_names(config).items():
        node = params
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        target = abstract_params
        for key in keys:
            target = target[key]
        stacked = keys[0] == "layers"
        read = [functools.partial(stored.to_jlong, checkpoint.tensor, entry) for entry in stored.entries]
        node[keys[-1]] = _placed(target, read, stacked)
    return params


def _placed(target: jax.ShapeDtypeStruct, read: list[Callable[[], np.ndarray]], stacked: bool) -> jax.Array:
    """An array shaped, typed and sharded like `target`, filled from `read`:
    one reader for the whole array, or one per entry of its leading (layers)
    axis when `stacked`. Devices that hold the same piece share one buffer."""
    dtype = np.dtype(target.dtype)
    pieces: dict[tuple, tuple[tuple[slice, ...], np.ndarray, list]] = {}  # bounds -> (index, buffer, devices)
    for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, target.shape))
        if key not in pieces:
            shape = tuple(stop - start for start, stop in key)
            pieces[key] = (tuple(slice(start, stop) for start, stop in key), np.empty(shape, dtype), [])
        pieces[key][2].append(device)
    if stacked:
        for layer, read_layer in enumerate(read):
            tensor = read_layer()
            for index, buffer, _ in pieces.values():
                if index[0].start <= layer < index[0].stop:
                    buffer[layer - index[0].start] = tensor[index[1:]]
    else:
        tensor = read[0]()
        for index, buffer, _ in pieces.values():
            buffer[...] = tensor[index]
    del tensor
    shards = [jax.device_put(buffer, device) for _, buffer, devices in pieces.values() for device in devices]
    return jax.make_array_from_single_device_arrays(target.shape, target.sharding, shards)


def from_hf(
    path: str | Path,
    *,
    param_dtype: str = "float32",
    options: ForwardOptions = ForwardOptions(),
) -> Transformer:
    """A jlong Transformer holding a Hugging Face checkpoint's weights, on the default device."""
    config = model_config_from_hf(path)
    model = nnx.eval_shape(
        lambda: Transformer(config, rngs=nnx.Rngs(0), param_dtype=param_dtype, options=options)
    )
    graphdef, state = nnx.split(model)
    device = SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), nnx.to_pure_dict(state)
    )
    nnx.replace_by_pure_dict(state, load_hf_params(path, config, abstract))
    return nnx.merge(graphdef, state)


# --------------------------------------------------------------------------
# Writing


def hf_tensors(model: Transformer) -> dict[str, np.ndarray]:
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors = {}
    for keys, stored in hf_tensor_names(model.config).items():
        value = params
        for key in keys:
            value = value[key]
        value = np.asarray(value)
        entries = value if keys[0] == "layers" else [value]
        for names, entry in zip(stored.entries, entries):
            tensors.update(zip(names, stored.to_hf(entry)))
    return {name: np.ascontiguousarray(np.asarray(t)) for name, t in tensors.items()}


def to_hf(model: Transformer, path: str | Path) -> None:
    """Writes config.json and safetensors shards that `transformers` loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size and size + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": {t: file for file, shard in zip(names, shards) for t in shard},
        }
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for file, shard in zip(names, shards):
        save_file({k: jax.numpy.asarray(v) for k, v in shard.items()}, path / file, metadata={"format": "pt"})
        with_normal_permissions(path / file)
    config = hf_config_dict(model.config)
    config["torch_dtype"] = str(next(iter(tensors.values())).dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
