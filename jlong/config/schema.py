"""The run configuration's schema: one frozen pydantic model per section.

A run is one YAML file whose top-level sections are `model`, `mesh`,
`attention`, `memory`, `train`, `data`, `checkpoint` and `eval`, plus `run_dir`
and, for a curriculum of lengths, `stages`.
Each section checks its own fields and the rules among them; the rules that
join sections (heads over sp, lengths over the mesh, tiles over shards) are
`jlong.config.validation`'s. Values derived from several sections (U, the
sequence granule) are resolved here, once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from jlong.config import validation
from jlong.config.registry import SP_METHODS
from jlong.config.types import (
    Flag,
    Integer,
    Mapping,
    NonNegativeInt,
    NonNegativeNumber,
    Number,
    PositiveInt,
    PositiveNumber,
    Paths,
    Text,
    as_integer,
    as_number,
    choice,
    optional,
    sequence_of,
)
from jlong.errors import JlongError
from jlong.options import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_DOCUMENTS, REMAT_NAMES, DType, RematName, RematSegment

# The share of each GPU a run asks XLA for by default. The rest is for what
# lives outside XLA's pool: the CUDA context, cuBLAS/cuDNN handles, NCCL's
# communication buffers (`jlong.planner.gpu_memory`).
DEFAULT_GPU_MEMORY_FRACTION = 0.94


def _heads_per_stage(value: Any) -> int | Literal["all", "auto"] | None:
    """U: unset (None: as many as mesh.sp), "all" (or 0), "auto" (the planner's choice), or a count of heads."""
    if value is None or value in ("all", "auto"):
        return value
    count = as_integer(value)
    if count < 0:
        raise ValueError(f"must not be negative, got {count}")
    return count or "all"


def _remat_runs(value: Any) -> dict[str, int]:
    """{policy: layers}: memory.remat's names, each with a positive count of layers."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"must be a mapping of memory.remat policies to layer counts, got {value!r}")
    for name, layers in value.items():
        if name not in REMAT_NAMES:
            raise ValueError(f"names {name!r}, which is not a memory.remat policy ({', '.join(REMAT_NAMES)})")
        if as_integer(layers) < 1:
            raise ValueError(f"gives {name} {layers} layers; each run needs at least 1")
    return {name: as_integer(layers) for name, layers in value.items()}


def _share(value: Any) -> float:
    share = as_number(value)
    if not 0 <= share <= 1:
        raise ValueError(f"must be in [0, 1], got {share:g}")
    return share


def _key_digits(value: Any) -> int:
    digits = as_integer(value)
    if not 1 <= digits <= 9:
        raise ValueError(f"must be 1 to 9, got {digits}")
    return digits


def _targets(value: Any) -> tuple[str, ...]:
    """lora.targets: one name or a list of names."""
    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("must be all-linear or a list of module names (q_proj, v_proj, ...)")
    return tuple(names)


def _fraction(value: Any) -> float:
    fraction = as_number(value)
    if not 0 < fraction <= 1:
        raise ValueError(f"must be in (0, 1], got {fraction:g}")
    return fraction


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelConfig(_Section):
    """Decoder architecture, named as in Hugging Face config.json files."""

    family: Text  # the model family (`jlong.families`), as Hugging Face's model_type names it
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: optional(PositiveInt) = None  # default: num_attention_heads
    head_dim: optional(PositiveInt) = None  # default: hidden_size // num_attention_heads
    rope_theta: Number = 10000.0
    rope_scaling: optional(Mapping) = None  # the llama3 form, or None for plain RoPE
    rms_norm_eps: Number = 1e-5
    tie_word_embeddings: Flag = False
    attention_bias: Flag = False  # q/k/v projection biases (Qwen2.x)
    qk_norm: Flag = False  # per-head RMSNorm of q and k (Qwen3)
    max_position_embeddings: optional(Integer) = None
    # Sliding-window attention (Gemma 3): the window of the "sliding_attention" layers among layer_types
    # (unset: every sliding_window_pattern-th layer is "full_attention", the rest sliding), their own RoPE
    # base, and the query scale's denominator (query_pre_attn_scalar^-1/2; default head_dim).
    sliding_window: optional(PositiveInt) = None
    layer_types: tuple[str, ...] | None = None
    sliding_window_pattern: optional(PositiveInt) = None
    rope_local_base_freq: optional(Number) = None
    query_pre_attn_scalar: optional(Number) = None
    # RoPE on the first partial_rotary_factor of each head's dimensions (Qwen3.5: 0.25); unset: all of them.
    partial_rotary_factor: optional(Number) = None
    # Linear-attention layers (Qwen3.5's Gated DeltaNet, the "linear_attention" layers among layer_types; unset:
    # every full_attention_interval-th layer is "full_attention"): key and value heads and their sizes, and the
    # kernel of the short causal convolution before the rule.
    full_attention_interval: optional(PositiveInt) = None
    linear_num_key_heads: optional(PositiveInt) = None
    linear_num_value_heads: optional(PositiveInt) = None
    linear_key_head_dim: optional(PositiveInt) = None
    linear_value_head_dim: optional(PositiveInt) = None
    linear_conv_kernel_dim: optional(PositiveInt) = None
    # Mixture of experts (Qwen3-MoE, Qwen3.5-MoE): num_experts SwiGLU experts of moe_intermediate_size, each token
    # routed to num_experts_per_tok of them, their router probabilities renormalised when norm_topk_prob. Qwen3-MoE's
    # dense layers (an MLP of intermediate_size): those in mlp_only_layers, and all but every decoder_sparse_step-th.
    # Qwen3.5-MoE's shared expert is an MLP of intermediate_size (its config.json's shared_expert_intermediate_size).
    # output_router_logits: Hugging Face's flag, read from and written to config.json; jlong trains the
    # load-balancing loss (router_aux_loss_coef x it) by train.router_aux_loss instead.
    num_experts: optional(PositiveInt) = None
    num_experts_per_tok: optional(PositiveInt) = None
    moe_intermediate_size: optional(PositiveInt) = None
    norm_topk_prob: Flag = False
    decoder_sparse_step: optional(PositiveInt) = None
    mlp_only_layers: tuple[int, ...] | None = None
    output_router_logits: Flag = False
    router_aux_loss_coef: Number = 0.001
    # GPT-OSS's experts: a clamped SwiGLU, (up + 1) x gate x sigmoid(swiglu_alpha x gate) with the gate clamped
    # above at swiglu_limit and up to [-swiglu_limit, swiglu_limit]; their size is intermediate_size, as in
    # Hugging Face's config (its router and experts have biases, and attention a sink logit per head).
    swiglu_limit: optional(PositiveNumber) = None
    swiglu_alpha: optional(PositiveNumber) = None
    preset: optional(Text) = None
    hf_path: optional(Text) = None

    def __hash__(self):  # rope_scaling is a dict; models keep this config as static data
        return hash(json.dumps(self.model_dump(), sort_keys=True))

    @model_validator(mode="before")
    @classmethod
    def _family(cls, values):
        return validation.with_family(values) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def _check(self):
        validation.check_model(self)
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dims(self) -> int:
        """How many of each head's dimensions RoPE rotates (the first ones)."""
        return int(self.dim_per_head * (self.partial_rotary_factor or 1.0))


class MeshConfig(_Section):
    data: PositiveInt = 1
    fsdp: PositiveInt = 1
    ring: PositiveInt = 1  # ring attention across these groups of sp devices (context parallel, e.g. across nodes)
    sp: PositiveInt = 1  # Ulysses: heads exchanged all-to-all within a group of sp devices

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.ring * self.sp

    @property
    def sequence_shards(self) -> int:
        """How many pieces each sequence is cut into, one per device: ring x sp."""
        return self.ring * self.sp


class AttentionConfig(_Section):
    impl: Text = "auto"  # auto, or a kernel of `jlong.attention.kernels` (cudnn, blockwise), or reference
    sp_method: Text = "ulysses"  # how attention spans the sp devices (`jlong.attention.methods`): ulysses, allgather
    # U: unset = the method's default (Ulysses: mesh.sp); "all" (or 0) = every head in one stage (plain Ulysses);
    # "auto" = the largest stage whose plan fits, chosen with memory.remat=auto (`jlong.planner.memory_choice`)
    heads_per_stage: Annotated[int | Literal["all", "auto"] | None, BeforeValidator(_heads_per_stage)] = None
    block_size: PositiveInt = DEFAULT_BLOCK_SIZE  # query/key block of the blockwise kernel
    max_documents: PositiveInt = DEFAULT_MAX_DOCUMENTS  # packed documents per sequence cuDNN takes (sizes its statistics)


class MemoryConfig(_Section):
    # auto: the planner chooses each layer's policy (and k) to fill both budgets (`jlong.planner.memory_choice`)
    remat: choice(Literal[RematName, "auto"]) = "none"
    layers_per_checkpoint: PositiveInt = 1  # with save_inputs / offload_inputs: one kept input per this many layers
    # The first layers in runs under policies of their own, in order, {policy: layers, ...}: for example
    # {save_attention: 1, offload_attention: 7} keeps attention's outputs on the device for the first layer and
    # in host memory for the next seven. The remaining layers follow remat; empty, every layer does.
    remat_runs: Annotated[dict, BeforeValidator(_remat_runs)] = {}
    optimizer_offload: Flag = False  # master parameters and AdamW moments in host memory
    mlp_tile: NonNegativeInt = 0  # tokens per tile of each device's sequence shard, 0 = untiled
    loss_tile: NonNegativeInt = 0


class KernelsConfig(_Section):
    """The GPU kernels of the token and channel mixers; `auto` picks by platform (the GPU's own on a GPU)."""

    gated_delta: Text = "auto"  # Gated DeltaNet's rule: auto, or one of `jlong.linear_attention.gated_delta.KERNELS`
    grouped_matmul: Text = "auto"  # the experts' grouped matmul: auto, or one of `jlong.moe.grouped_matmul.KERNELS`


class TrainConfig(_Section):
    steps: PositiveInt = 100
    seq_len: PositiveInt = 2048
    batch_size: PositiveInt = 8  # global sequences per step
    lr: PositiveNumber = 3e-4
    min_lr_ratio: Number = 0.1
    warmup_steps: NonNegativeInt = 10
    weight_decay: NonNegativeNumber = 0.1
    grad_clip: NonNegativeNumber = 1.0
    b1: Number = 0.9
    b2: Number = 0.95
    eps: Number = 1e-8
    seed: Integer = 0
    param_dtype: choice(DType) = "float32"
    compute_dtype: choice(DType) = "bfloat16"
    profile_start: Integer = 3  # first step of the jax.profiler trace window
    profile_steps: NonNegativeInt = 0  # steps to trace into run_dir/profile; 0 = no trace
    # The share of each GPU's memory the run asks XLA for (XLA_PYTHON_CLIENT_MEM_FRACTION);
    # the planner's default device budget follows it.
    gpu_memory_fraction: Annotated[float, BeforeValidator(_fraction)] = DEFAULT_GPU_MEMORY_FRACTION
    eval_every: NonNegativeInt = 0  # steps between evaluations of loss by position on eval.path; 0 = none
    # Where each step's metrics go besides run_dir/metrics.jsonl (always written: resuming and loss.png read it).
    log_to: sequence_of(choice(Literal["jsonl", "tensorboard", "wandb"])) = ("jsonl",)
    # Step 1 from these weights (a jlong checkpoint directory or a Hugging Face one), with a fresh optimizer.
    init_from: optional(Text) = None
    # On a GPU, compare the step's host bytes on each node with the node's available memory before step 1.
    check_host_memory: Flag = True
    # A mixture of experts adds model.router_aux_loss_coef x the load-balancing loss to its training loss.
    router_aux_loss: Flag = True
    # lm: next-token cross-entropy; dpo: Direct Preference Optimization on preference pairs
    # (`jlong prepare --preference`, data.sampling=pairs), against a reference model (`jlong.model.preference`).
    objective: choice(Literal["lm", "dpo"]) = "lm"
    dpo_beta: PositiveNumber = 0.1  # DPO's beta: how far the policy may move from the reference


class LoraConfig(_Section):
    """LoRA: the base frozen, low-rank adapters trained on the linear layers `targets` names (`jlong.lora`)."""

    rank: PositiveInt = 16
    alpha: PositiveNumber = 16.0  # the adapters' product is scaled by alpha / rank, as PEFT's lora_alpha
    # PEFT's target_modules names (q_proj, down_proj, in_proj_qkv, ...), or all-linear: every linear layer of
    # the layers (not the output layer, not a mixture's routed experts).
    targets: Annotated[tuple[str, ...], BeforeValidator(_targets)] = ("all-linear",)
    # The frozen base: in train.compute_dtype, or in 4-bit NormalFloat with blockwise scales (QLoRA).
    base_dtype: choice(Literal["compute", "nf4"]) = "compute"
    init_from: optional(Text) = None  # a PEFT adapter directory to start the adapters from


Sampling = choice(Literal["windows", "documents", "pairs"])


class CorpusEntry(_Section):
    """One weighted token corpus of a mixture (`eval.mix`; `data.mix` adds sampling settings)."""

    path: Paths  # a token file, a directory of shards, or a list of them
    weight: PositiveNumber = 1.0  # its share: weight / the sum of the weights
    name: optional(Text) = None  # in metrics (tokens_by_source, loss by source); default: the path's stem
    eos_id: optional(Integer) = None  # its own end-of-document id (default: data.eos_id)

    @property
    def label(self) -> str:
        first = self.path if isinstance(self.path, str) else self.path[0]
        return self.name or Path(first).name.removesuffix(".npy") or first


class MixSource(CorpusEntry):
    """One source of `data.mix`; unset settings are data's own."""

    sampling: optional(Sampling) = None
    long_document_weight: optional(PositiveNumber) = None
    shuffle: optional(Flag) = None


def mix_entries(entries, entry_type: type[CorpusEntry], key: str) -> list:
    """A mixture's entries, checked: a bad entry, or two with one name, is one line naming it."""
    parsed = []
    for i, entry in enumerate(entries or ()):
        try:
            parsed.append(entry_type(**entry))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            if first["type"] == "extra_forbidden":
                message = f"is not a setting of a mixture's entry ({', '.join(entry_type.model_fields)})"
            elif first["type"] == "missing":
                message = "is required"
            raise JlongError(f"{key}[{i}].{where} {message}") from None
    names = [entry.label for entry in parsed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise JlongError(f"{key} names {', '.join(map(repr, twice))} more than once: give the entries distinct "
                         "names (name: ...)")
    return parsed


class DataConfig(_Section):
    source: choice(Literal["synthetic", "tokens"]) = "synthetic"
    path: optional(Paths) = None  # a token file, a directory of shards (`jlong prepare --shard-tokens`), or a list
    # a weighted mixture of token corpora in place of path: a list of MixSource entries
    mix: optional(sequence_of(Mapping)) = None
    shuffle: Flag = False
    # set: packed documents split at this token; unset: the one `jlong prepare` recorded, for document sampling
    # and conversations (`jlong.data.recorded`)
    eos_id: optional(Integer) = None
    # train only the ids a token file's mask marks (`jlong prepare --chat`); unset: when the files have masks
    loss_mask: optional(Flag) = None
    # windows: contiguous windows of the token file; documents: sequences packed from whole documents;
    # pairs: whole preference pairs packed (`jlong prepare --preference`; the default of train.objective=dpo)
    sampling: Sampling = "windows"
    # documents: how many times as often as the others a document of at least train.seq_len tokens is drawn
    long_document_weight: PositiveNumber = 1.0

    @model_validator(mode="after")
    def _check(self):
        if self.mix is not None:
            self._check_mix()
        elif self.source == "tokens" and not self.path:
            raise JlongError("data.source=tokens needs data.path (a 1-D integer .npy of token ids, or a directory "
                             "of shards) or data.mix")
        if self.sampling == "documents" and self.source != "tokens":
            raise JlongError("data.sampling=documents packs documents of a token file: it needs data.source=tokens")
        if self.long_document_weight < 1:
            raise JlongError(f"data.long_document_weight ({self.long_document_weight:g}) must be at least 1")
        return self

    def _check_mix(self) -> None:
        if self.path:
            raise JlongError("data.mix replaces data.path: set one of them (data.path=null to train on the mix)")
        if self.source != "tokens":
            raise JlongError("data.mix mixes token corpora: set data.source=tokens")
        if not self.mix:
            raise JlongError("data.mix is empty: give at least one {path: ..., weight: ...} entry")
        for i, source in enumerate(self.mix_sources):
            if source.eos_id is not None and self.eos_id is None:
                raise JlongError(f"data.mix[{i}].eos_id needs data.eos_id set too (it turns on document masking "
                                 "for the whole run)")
            if source.long_document_weight is not None and source.long_document_weight < 1:
                raise JlongError(f"data.mix[{i}].long_document_weight ({source.long_document_weight:g}) must be "
                                 "at least 1")

    @property
    def mix_sources(self) -> list[MixSource]:
        """data.mix's entries, checked."""
        return mix_entries(self.mix, MixSource, "data.mix")


class EvalConfig(_Section):
    path: optional(Paths) = None  # held-out tokens (a .npy or shards, like data.path) for the loss by position
    # held-out corpora in place of path, each scored on its own: a list of {path, weight, name, eos_id}
    mix: optional(sequence_of(Mapping)) = None
    sequences: PositiveInt = 8  # train.seq_len windows of held-out tokens to score (a mix: split by weight)
    passkey_trials: NonNegativeInt = 4  # per (length, depth) cell; 0 = no passkey retrieval
    passkey_lengths: optional(sequence_of(PositiveInt)) = None  # default: seq_len/8, /4, /2 and seq_len
    passkey_depths: sequence_of(Annotated[float, BeforeValidator(_share)]) = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_digits: Annotated[int, BeforeValidator(_key_digits)] = 5  # the key's length; 1: reach without copying
    tokenizer: optional(Text) = None  # a Hugging Face tokenizer.json or directory for the passkey's text

    @model_validator(mode="after")
    def _check(self):
        if self.mix is not None:
            if self.path:
                raise JlongError("eval.mix replaces eval.path: set one of them")
            if not self.mix:
                raise JlongError("eval.mix is empty: give at least one {path: ..., weight: ...} entry")
            mix_entries(self.mix, CorpusEntry, "eval.mix")
        return self

    @property
    def held_out(self) -> bool:
        """Whether held-out tokens are named (eval.path or eval.mix)."""
        return bool(self.path or self.mix)

    @property
    def mix_sources(self) -> list[CorpusEntry]:
        """eval.mix's entries, checked."""
        return mix_entries(self.mix, CorpusEntry, "eval.mix")


class CheckpointConfig(_Section):
    dir: optional(Text) = None
    every: NonNegativeInt = 0  # steps between checkpoints; 0 = only at the end
    keep: PositiveInt = 2


class Stage(_Section):
    """One stage of a run's length curriculum (`jlong.config.stages`)."""

    until_step: PositiveInt  # the stage's last step
    set: Mapping = {}  # dotted keys -> values, over the run's config


class Config(_Section):
    model: ModelConfig
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    lora: LoraConfig | None = None  # LoRA / QLoRA fine-tuning; None: every parameter trains
    run_dir: optional(Text) = None
    stages: tuple[Stage, ...] = ()  # a curriculum: each stage's settings until its step (jlong.config.stages)

    @model_validator(mode="before")
    @classmethod
    def _pairs_for_dpo(cls, raw):
        """DPO reads whole preference pairs: data.sampling=pairs unless set."""
        if isinstance(raw, dict) and isinstance(raw.get("train"), dict) and raw["train"].get("objective") == "dpo":
            data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
            if "sampling" not in data:
                raw = {**raw, "data": {**data, "sampling": "pairs"}}
        return raw

    @model_validator(mode="after")
    def _check(self):
        validation.check_run(self)
        return self

    @property
    def heads_per_stage(self) -> int:
        """U resolved: the sequence-parallel method's default unless set, every head for "all"."""
        return SP_METHODS.named(self.attention.sp_method).heads_per_stage(self)

    @property
    def chooses_layout(self) -> bool:
        """Whether the planner still has settings to choose (memory.remat or attention.heads_per_stage is
        auto): `jlong.planner.memory_choice.choose` resolves them before a program is built."""
        return self.memory.remat == "auto" or self.attention.heads_per_stage == "auto"

    @property
    def remat_segments(self) -> tuple[RematSegment, ...]:
        """The layers in runs under one remat policy, first to last: memory.remat_runs' (one input
        per layer), then the rest under memory.remat."""
        memory = self.memory
        if memory.remat == "auto":
            raise JlongError("memory.remat=auto is chosen by the planner before a program is built: resolve the "
                             "config with jlong.planner.memory_choice.choose first")
        runs = tuple(RematSegment(remat, layers) for remat, layers in memory.remat_runs.items())
        rest = self.model.num_hidden_layers - sum(run.layers for run in runs)
        return (*runs, RematSegment(memory.remat, rest, memory.layers_per_checkpoint))

    @property
    def shard_tokens(self) -> int:
        """Tokens of each sequence that one device holds: seq_len / (ring x sp)."""
        return self.train.seq_len // self.mesh.sequence_shards

    @property
    def sequence_granule(self) -> int:
        """What every workable seq_len of this config is a multiple of: the
        sequence-parallel method's granule, every device's shard a multiple
        of each tile in use, and in a zigzag layout every chunk a multiple of
        the attention block."""
        method = SP_METHODS.named(self.attention.sp_method)
        tiles = [t for t in (self.memory.mlp_tile, self.memory.loss_tile) if t]
        multiples = [method.granule(self)[0], self.mesh.sequence_shards * math.lcm(1, *tiles)]
        if (ranks := method.layout(self).ranks) > 1:
            multiples.append(2 * ranks * self.attention.block_size)
        return math.lcm(*multiples)


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation for name, field in Config.model_fields.items() if name not in ("run_dir", "stages", "lora")
} | {"lora": LoraConfig}
