"""Typed run configuration: dataclasses, YAML loading, dotted overrides, validation.

A run is described by one YAML file whose top-level sections are the
dataclasses below (`model`, `mesh`, `attention`, `memory`, `train`, `data`,
`checkpoint`) plus `run_dir`. Any key can be overridden on the command line as
`section.key=value` (the value is parsed as YAML). Every problem is reported
as a `JlongError` with one line that names the key and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jlong.errors import JlongError
from jlong.plan.gpu_memory import DEFAULT_GPU_MEMORY_FRACTION
from jlong.hf_config import read_hf_config
from jlong.options import AttentionImpl, DType, RematName


@dataclass(frozen=True)
class ModelConfig:
    """Decoder architecture, named as in Hugging Face config.json files."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # default: num_attention_heads
    head_dim: int | None = None  # default: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # the llama3 form, or None for plain RoPE
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection biases (Qwen2.x)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    max_position_embeddings: int | None = None
    preset: str | None = None
    hf_path: str | None = None

    def __hash__(self):  # rope_scaling is a dict; models keep this config as static data
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def hf_architecture(self) -> str:
        """The transformers class that has exactly this architecture."""
        if self.qk_norm:
            return "Qwen3ForCausalLM"
        if self.attention_bias:
            return "Qwen2ForCausalLM"
        return "LlamaForCausalLM"


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = 1
    ring: int = 1  # ring attention across these groups of sp devices (context parallel, e.g. across nodes)
    sp: int = 1  # Ulysses: heads exchanged all-to-all within a group of sp devices

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.ring * self.sp

    @property
    def sequence_shards(self) -> int:
        """How many pieces each sequence is cut into, one per device: ring x sp."""
        return self.ring * self.sp

    @property
    def sequence_granule(self) -> int:
        """What seq_len must be a multiple of: one token per device, and with a
        ring, the zigzag layout's 2 x ring chunks (`jlong.parallel.zigzag`)."""
        return self.sp * (2 * self.ring if self.ring > 1 else 1)


@dataclass(frozen=True)
class AttentionConfig:
    impl: AttentionImpl = "auto"
    heads_per_stage: int | None = None  # U; None = mesh.sp, 0 = all heads
    block_size: int = 512  # query/key block of the blockwise kernel
    max_documents: int = 64  # packed documents per sequence cuDNN takes (sizes its statistics)


@dataclass(frozen=True)
class MemoryConfig:
    remat: RematName = "none"
    layers_per_checkpoint: int = 1  # with save_inputs / offload_inputs: one kept input per this many layers
    optimizer_offload: bool = False  # master parameters and AdamW moments in host memory
    mlp_tile: int = 0  # tokens per tile of each device's sequence shard, 0 = untiled
    loss_tile: int = 0


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    seq_len: int = 2048
    batch_size: int = 8  # global sequences per step
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    seed: int = 0
    param_dtype: DType = "float32"
    compute_dtype: DType = "bfloat16"
    profile_start: int = 3  # first step of the jax.profiler trace window
    profile_steps: int = 0  # steps to trace into run_dir/profile; 0 = no trace
    # The share of each GPU's memory the run asks XLA for (XLA_PYTHON_CLIENT_MEM_FRACTION);
    # the planner's default device budget follows it.
    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION


@dataclass(frozen=True)
class DataConfig:
    source: Literal["synthetic", "tokens"] = "synthetic"
    path: str | None = None
    shuffle: bool = False
    eos_id: int | None = None  # set: packed documents split at this token


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    mesh: MeshConfig = field(default_factory=MeshConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run_dir: str | None = None

    @property
    def heads_per_stage(self) -> int:
        """U resolved: the default is the sp degree, 0 means all heads."""
        u = self.attention.heads_per_stage
        if u is None:
            u = self.mesh.sp
        return u or self.model.num_attention_heads


SECTIONS: dict[str, type] = {
    name: hint for name, hint in typing.get_type_hints(Config).items() if name != "run_dir"
}


# --------------------------------------------------------------------------
# Presets


def presets_dir() -> Path:
    """configs/models of the source tree (or of the installed package)."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "configs" / "models", here / "configs" / "models"):
        if candidate.is_dir():
            return candidate
    raise JlongError("cannot find the model presets directory configs/models")


def preset_names() -> list[str]:
    return sorted(p.stem for p in presets_dir().glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    path = presets_dir() / f"{name}.yaml"
    if not path.is_file():
        names = preset_names()
        raise JlongError(
            f"unknown model.preset {name!r}{_did_you_mean(name, names)}; "
            f"available: {', '.join(names)}"
        )
    return _read_yaml(path)


# --------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None, overrides: list[str] = (), *, base: dict | None = None) -> Config:
    """Reads a YAML config (or starts from `base`, a config's dict), applies
    `a.b=value` overrides, validates."""
    raw = _read_yaml(Path(path)) if path is not None else copy.deepcopy(base or {})
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw)


def config_from_dict(raw: dict[str, Any]) -> Config:
    raw = dict(raw)
    known = [*SECTIONS, "run_dir"]
    for key in raw:
        if key not in known:
            raise JlongError(f"unknown config section {key!r}{_did_you_mean(key, known)}")
    if "model" not in raw:
        raise JlongError("the config has no 'model' section: set model.preset or model.hf_path")
    sections = {}
    for name, cls in SECTIONS.items():
        values = raw.get(name) or {}
        if not isinstance(values, dict):
            raise JlongError(f"config section {name!r} must be a mapping of keys, got {values!r}")
        if name == "model":
            values = _resolve_model_fields(values)
        sections[name] = build_section(cls, values, name)
    run_dir = raw.get("run_dir")
    if run_dir is not None and not isinstance(run_dir, str):
        raise JlongError(f"run_dir must be a path string, got {run_dir!r}")
    config = Config(**sections, run_dir=run_dir)
    validate(config)
    return config


def config_to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def _resolve_model_fields(values: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields: preset or HF config.json first, inline keys on top."""
    base: dict[str, Any] = {}
    if values.get("preset") is not None:
        if not isinstance(values["preset"], str):
            raise JlongError(f"model.preset must be a name, got {values['preset']!r}")
        base.update(load_preset(values["preset"]))
    if values.get("hf_path") is not None:
        checkpoint = read_hf_config(values["hf_path"])
        _check_matches_checkpoint(values, checkpoint)
        base.update(checkpoint)
    return {**base, **values}


# The fields that give the weights their shapes and roles: a checkpoint's
# config.json decides them. The others (RoPE, norm epsilon, positions) may be
# set inline over a checkpoint, to train it at a longer context, say.
WEIGHT_DEFINING_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm",
)


def _check_matches_checkpoint(inline: dict[str, Any], checkpoint: dict[str, Any]) -> None:
    hints = typing.get_type_hints(ModelConfig)
    for key in WEIGHT_DEFINING_FIELDS:
        if key not in inline or key not in checkpoint:
            continue
        if _coerce(inline[key], hints[key], f"model.{key}") != checkpoint[key]:
            raise JlongError(
                f"model.{key}={inline[key]!r} contradicts the checkpoint model.hf_path={inline['hf_path']!r}, "
                f"whose config.json has {key}={checkpoint[key]!r}; drop model.{key} (the checkpoint decides "
                "the shapes of its weights)"
            )


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise JlongError(f"config file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "malformed YAML"
        raise JlongError(f"cannot parse {path}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JlongError(f"{path} must hold a YAML mapping of sections, not {type(data).__name__}")
    return data


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise JlongError(f"override {override!r} must look like section.key=value")
    try:
        value = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        value = text
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise JlongError(f"override {override!r}: {part!r} is not a section")
        node = child
    node[leaf] = value


def build_section(cls: type, values: dict[str, Any], section: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in values:
        if key not in names:
            full = [f"{section}.{n}" for n in names]
            raise JlongError(
                f"unknown config key {section}.{key}{_did_you_mean(f'{section}.{key}', full)}"
            )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = _coerce(values[f.name], hints[f.name], f"{section}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise JlongError(
                f"{section}.{f.name} is required: set it, or set model.preset / model.hf_path"
            )
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _coerce(value, inner, key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = _did_you_mean(str(value), list(choices))
            raise JlongError(f"{key} must be one of {', '.join(choices)}; got {value!r}{hint}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise JlongError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        number = _as_number(value)
        if number is not None and float(number).is_integer():
            return int(number)
        raise JlongError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        number = _as_number(value)
        if number is not None:
            return float(number)
        raise JlongError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise JlongError(f"{key} must be a string, got {value!r}")
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise JlongError(f"{key} must be a mapping, got {value!r}")
    raise TypeError(f"config field {key} has an unsupported type {tp}")


def _as_number(value: Any) -> float | int | None:
    """Numbers, and numeric strings such as '5e6' that YAML 1.1 leaves as text."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            return None
        return number if math.isfinite(number) else None
    return None


def _did_you_mean(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# --------------------------------------------------------------------------
# Validation of values that each make sense alone but not together


def validate(config: Config) -> None:
    mesh, train, att = config.mesh, config.train, config.attention
    validate_model(config.model)
    _positive(
        {
            "mesh.data": mesh.data,
            "mesh.fsdp": mesh.fsdp,
            "mesh.ring": mesh.ring,
            "mesh.sp": mesh.sp,
            "attention.block_size": att.block_size,
            "attention.max_documents": att.max_documents,
            "train.steps": train.steps,
            "train.seq_len": train.seq_len,
            "train.batch_size": train.batch_size,
            "checkpoint.keep": config.checkpoint.keep,
        }
    )
    _non_negative(
        {
            "memory.mlp_tile": config.memory.mlp_tile,
            "memory.loss_tile": config.memory.loss_tile,
            "train.warmup_steps": train.warmup_steps,
            "train.weight_decay": train.weight_decay,
            "train.grad_clip": train.grad_clip,
            "checkpoint.every": config.checkpoint.every,
            "train.profile_steps": train.profile_steps,
            "attention.heads_per_stage": att.heads_per_stage or 0,
        }
    )
    # The heads sp must split come before lengths: no sequence length helps a split that cannot work.
    _validate_head_split(config)
    batch_split = mesh.data * mesh.fsdp
    if train.batch_size % batch_split:
        raise JlongError(
            f"train.batch_size ({train.batch_size}) must be a multiple of mesh.data x mesh.fsdp "
            f"({batch_split}): each of those ranks takes whole sequences"
        )
    granule = mesh.sequence_granule
    if train.seq_len % granule:
        lower = train.seq_len // granule * granule
        what = f"mesh.sp ({mesh.sp})" if mesh.ring == 1 else (
            f"2 x mesh.ring x mesh.sp ({granule}: the zigzag layout cuts the sequence into 2 x ring chunks, "
            f"each split over sp)")
        raise JlongError(
            f"train.seq_len ({train.seq_len}) must be a multiple of {what}; "
            f"nearest valid: {lower or granule} or {lower + granule}"
        )
    _validate_ring_blocks(config)
    if not train.lr > 0:
        raise JlongError(f"train.lr must be positive, got {train.lr}")
    if not 0 < train.gpu_memory_fraction <= 1:
        raise JlongError(f"train.gpu_memory_fraction must be in (0, 1], got {train.gpu_memory_fraction:g}")
    _validate_tiles(config)
    _validate_layer_groups(config)
    if config.data.source == "tokens" and not config.data.path:
        raise JlongError("data.source=tokens needs data.path, a 1-D integer .npy of token ids")


def _validate_head_split(config: Config) -> None:
    """Ulysses splits the query heads over sp; UPipe runs them in stages of U."""
    H, sp = config.model.num_attention_heads, config.mesh.sp
    if H % sp:
        workable = [c for c in range(1, H + 1) if H % c == 0]
        raise JlongError(
            f"model.num_attention_heads ({H}) is not divisible by mesh.sp ({sp}); "
            f"sp degrees that work: {', '.join(map(str, workable))}"
        )
    U = config.heads_per_stage
    if U % sp or H % U:
        workable = [u for u in range(sp, H + 1, sp) if H % u == 0]
        raise JlongError(
            f"attention.heads_per_stage ({U}) must be a multiple of mesh.sp ({sp}) that divides "
            f"the {H} heads; values that work: {', '.join(map(str, workable))} (or 0 for all heads)"
        )
    if config.train.profile_steps and not config.run_dir:
        raise JlongError("train.profile_steps writes its trace into run_dir: set run_dir")


def _validate_ring_blocks(config: Config) -> None:
    """Ring attention's steps walk each zigzag chunk (seq_len / (2 x ring) tokens) in whole blocks."""
    if config.mesh.ring == 1:
        return
    chunk, block = config.train.seq_len // (2 * config.mesh.ring), config.attention.block_size
    if chunk % min(block, chunk):
        raise JlongError(
            f"attention.block_size ({block}) must divide the {chunk} tokens of each zigzag chunk "
            f"(train.seq_len / (2 x mesh.ring)) with ring attention"
        )


def _validate_tiles(config: Config) -> None:
    """Tiles cut each device's shard of seq_len / (ring x sp) tokens evenly."""
    local = config.train.seq_len // config.mesh.sequence_shards
    for key in ("mlp_tile", "loss_tile"):
        tile = getattr(config.memory, key)
        if tile and local % tile:
            divisors = [t for t in range(1, local + 1) if local % t == 0]
            nearest = sorted(divisors, key=lambda t: abs(t - tile))[:2]
            raise JlongError(
                f"memory.{key} ({tile}) must divide the {local} tokens each device holds "
                f"(train.seq_len / (mesh.ring x mesh.sp)); nearest that work: {', '.join(map(str, sorted(nearest)))}"
            )


def _validate_layer_groups(config: Config) -> None:
    k, layers, remat = config.memory.layers_per_checkpoint, config.model.num_hidden_layers, config.memory.remat
    if k < 1:
        raise JlongError(f"memory.layers_per_checkpoint must be positive, got {k}")
    if k > 1 and remat not in ("save_inputs", "offload_inputs"):
        raise JlongError(
            f"memory.layers_per_checkpoint={k} groups the layer inputs that memory.remat keeps: "
            f"use it with memory.remat=save_inputs or offload_inputs (got {remat})"
        )
    if layers % k:
        workable = [g for g in range(1, layers + 1) if layers % g == 0]
        raise JlongError(
            f"memory.layers_per_checkpoint ({k}) must divide the {layers} layers; "
            f"values that work: {', '.join(map(str, workable))}"
        )


def validate_model(m: ModelConfig) -> None:
    _positive(
        {
            "model.vocab_size": m.vocab_size,
            "model.hidden_size": m.hidden_size,
            "model.intermediate_size": m.intermediate_size,
            "model.num_hidden_layers": m.num_hidden_layers,
            "model.num_attention_heads": m.num_attention_heads,
            "model.num_key_value_heads": m.kv_heads,
            "model.head_dim": m.dim_per_head,
        }
    )
    if m.num_attention_heads % m.kv_heads:
        raise JlongError(
            f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({m.kv_heads})"
        )
    if m.dim_per_head % 2:
        raise JlongError(f"model.head_dim must be even for rotary embeddings, got {m.dim_per_head}")
    if m.rope_scaling is not None:
        _validate_rope_scaling(m.rope_scaling)


LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _validate_rope_scaling(scaling: dict) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return
    if kind != "llama3":
        raise JlongError(
            f"model.rope_scaling.rope_type {kind!r} is not supported; use 'llama3' or null"
        )
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in scaling]
    if missing:
        raise JlongError(f"model.rope_scaling (llama3) lacks {', '.join(missing)}")


def _positive(values: dict[str, int]) -> None:
    for key, value in values.items():
        if value <= 0:
            raise JlongError(f"{key} must be positive, got {value}")


def _non_negative(values: dict[str, float]) -> None:
    for key, value in values.items():
        if value < 0:
            raise JlongError(f"{key} must not be negative, got {value}")
