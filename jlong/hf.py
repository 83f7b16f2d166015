"""Hugging Face checkpoints: config.json + *.safetensors <-> jlong models.

config.json is read and written by `jlong.hf_config`. Tensor names and
layouts follow LlamaForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM.
"""

from __future__ import annotations

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
from jlong.errors import JlongError
from jlong.files import with_normal_permissions
from jlong.hf_config import hf_config_dict, read_hf_config
from jlong.model.params import Role, layer_params, outer_params, roles
from jlong.model.transformer import ForwardOptions, Transformer

SHARD_BYTES = 4 << 30  # safetensors file size cap when writing


# --------------------------------------------------------------------------
# config.json


def model_config_from_hf(path: str | Path) -> ModelConfig:
    return model_config({**read_hf_config(path), "hf_path": str(path)})


# --------------------------------------------------------------------------
# Tensor names and layouts
#
# Each entry: jlong layer parameter -> (HF tensor suffix, HF -> jlong, jlong -> HF).
# HF linear weights are [out, in]; jlong keeps [in, heads, head_dim] and
# [heads, head_dim, out] so attention can slice heads.


def _layer_tensor_map(config: ModelConfig) -> dict[str, tuple[str, Callable, Callable]]:
    D, H, K, d = config.hidden_size, config.num_attention_heads, config.kv_heads, config.dim_per_head

    def in_heads(n):
        return (lambda w: w.T.reshape(D, n, d), lambda w: w.reshape(D, n * d).T)

    def heads(n):
        return (lambda b: b.reshape(n, d), lambda b: b.reshape(n * d))

    transpose = (lambda w: w.T, lambda w: w.T)
    same = (lambda w: w, lambda w: w)
    table = {
        "attn_norm": ("input_layernorm.weight", *same),
        "wq": ("self_attn.q_proj.weight", *in_heads(H)),
        "wk": ("self_attn.k_proj.weight", *in_heads(K)),
        "wv": ("self_attn.v_proj.weight", *in_heads(K)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, d, D), lambda w: w.reshape(H * d, D).T),
        "mlp_norm": ("post_attention_layernorm.weight", *same),
        "w_gate": ("mlp.gate_proj.weight", *transpose),
        "w_up": ("mlp.up_proj.weight", *transpose),
        "w_down": ("mlp.down_proj.weight", *transpose),
        "bq": ("self_attn.q_proj.bias", *heads(H)),
        "bk": ("self_attn.k_proj.bias", *heads(K)),
        "bv": ("self_attn.v_proj.bias", *heads(K)),
        "q_norm": ("self_attn.q_norm.weight", *same),
        "k_norm": ("self_attn.k_norm.weight", *same),
    }
    return {name: table[name] for name in layer_params(config)}


def _param_sources(config: ModelConfig) -> dict[tuple[str, ...], tuple[list[str], Callable]]:
    """Each jlong parameter (its path in the parameter dict) -> the HF tensors
    it is built from (one per layer for stacked layer parameters) and the
    HF -> jlong layout change of one tensor."""
    sources = {
        ("embed",): ([OUTER_TENSORS["embed"]], lambda w: w),
        ("final_norm",): ([OUTER_TENSORS["final_norm"]], lambda w: w),
    }
    if not config.tie_word_embeddings:
        sources[("lm_head",)] = ([OUTER_TENSORS["lm_head"]], lambda w: w.T)
    for name, (suffix, to_jlong, _) in _layer_tensor_map(config).items():
        names = [f"model.layers.{i}.{suffix}" for i in range(config.num_hidden_layers)]
        sources[("layers", name)] = (names, to_jlong)
    return sources


OUTER_TENSORS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def hf_roles(config: ModelConfig) -> dict[str, Role]:
    """The role (`jlong.model.params`) of each Hugging Face tensor of the model."""
    role = roles(config)
    tensors = {OUTER_TENSORS[name]: role[name] for name in outer_params(config)}
    for name, (suffix, _, _) in _layer_tensor_map(config).items():
        tensors.update({f"model.layers.{i}.{suffix}": role[name] for i in range(config.num_hidden_layers)})
    return tensors


def _expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for name, (suffix, _, to_hf) in _layer_tensor_map(config).items():
        shape = layer_params(config)[name].shape
        hf_shape = jax.eval_shape(to_hf, jax.ShapeDtypeStruct(shape, np.float32)).shape
        for i in range(config.num_hidden_layers):
            shapes[f"model.layers.{i}.{suffix}"] = hf_shape
    V, D = config.vocab_size, config.hidden_size
    shapes["model.embed_tokens.weight"] = (V, D)
    shapes["model.norm.weight"] = (D,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
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


class _Checkpoint:
    """A checkpoint's safetensors files, checked against the config's shapes
    before anything is read, and read one tensor at a time."""

    def __init__(self, path: Path, config: ModelConfig):
        self.files = _safetensors_files(path)
        expected = _expected_hf_shapes(config)
        missing = [name for name in expected if name not in self.files]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise JlongError(f"{path}: checkpoint lacks tensors {', '.join(missing[:3])}{more}")
        for name, shape in expected.items():
            with safe_open(self.files[name], framework="numpy") as f:
                found = tuple(f.get_slice(name).get_shape())
            if found != shape:
                raise JlongError(
                    f"{self.files[name].name}: tensor {name} has shape {found}, but config.json implies {shape}"
                )

    def tensor(self, name: str) -> np.ndarray:
        with safe_open(self.files[name], framework="numpy") as f:
            return f.get_tensor(name)


def load_hf_params(path: str | Path, config: ModelConfig, abstract_params: dict) -> dict:
    """A checkpoint's weights as jlong's parameter dict, each array built in
    the sharding and dtype of its `abstract_params` entry (ShapeDtypeStructs
    with shardings).

    Nothing passes whole through one device, and the host holds one HF tensor
    at a time beside the shards being filled: each tensor is read, laid out,
    cut into the pieces the devices hold and dropped."""
    checkpoint = _Checkpoint(Path(path), config)
    params: dict = {}
    for keys, (names, to_jlong) in _param_sources(config).items():
        node = params
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        target = abstract_params
        for key in keys:
            target = target[key]
        stacked = keys[0] == "layers"
        node[keys[-1]] = _placed(target, [lambda n=n: to_jlong(checkpoint.tensor(n)) for n in names], stacked)
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
    config = model.config
    tensors = {
        "model.embed_tokens.weight": model.embed.get_value(),
        "model.norm.weight": model.final_norm.get_value(),
    }
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = model.lm_head.get_value().T
    for name, (suffix, _, to_hf) in _layer_tensor_map(config).items():
        stacked = np.asarray(getattr(model.layers, name).get_value())
        for i, layer in enumerate(stacked):
            tensors[f"model.layers.{i}.{suffix}"] = to_hf(layer)
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
