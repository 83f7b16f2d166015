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
    # Each field's description is the docstring under it (pydantic's `description`): the configuration
    # reference (`jlong.docgen`) is generated from them.
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class ModelConfig(_Section):
    """Decoder architecture, named as in Hugging Face config.json files."""

    family: Text
    """The model family (`jlong.families`), as Hugging Face's `model_type` names it, or one a script registers
    (`jlong.families.register`). Unset: the preset's or config.json's `model_type`, else what the flags imply
    (`qk_norm`: qwen3, `attention_bias`: qwen2, neither: llama). The family's defaults lie beneath the fields set."""
    vocab_size: PositiveInt
    """Token ids in the vocabulary: the embedding's rows and the output projection's columns."""
    hidden_size: PositiveInt
    """The model's width: each token's hidden state."""
    intermediate_size: PositiveInt
    """The gated MLP's inner size (GPT-OSS: each expert's; Qwen3.5-MoE: its shared expert's, config.json's
    `shared_expert_intermediate_size`)."""
    num_hidden_layers: PositiveInt
    """Decoder layers."""
    num_attention_heads: PositiveInt
    """Query heads of each attention layer."""
    num_key_value_heads: optional(PositiveInt) = None
    """Key and value heads (grouped-query attention); unset: `num_attention_heads`."""
    head_dim: optional(PositiveInt) = None
    """Each attention head's size; unset: `hidden_size // num_attention_heads`."""
    rope_theta: Number = 10000.0
    """RoPE's base (of the full-attention layers, where a family's layer types have bases of their own)."""
    rope_scaling: optional(Mapping) = None
    """Hugging Face's RoPE scaling; unset: plain RoPE. `rope_type` `linear` (`factor`), `llama3` (`factor,
    low_freq_factor, high_freq_factor, original_max_position_embeddings`) or `yarn` (`factor,
    original_max_position_embeddings`; optional `beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim,
    truncate`), read from either config.json form (transformers 4's `rope_scaling`, 5's `rope_parameters`) and
    written back by `jlong convert`; other types are refused. Each gives transformers' logits (float32, 1e-4,
    tested past the original context)."""
    rms_norm_eps: Number = 1e-5
    """RMSNorm's epsilon."""
    tie_word_embeddings: Flag = False
    """The output projection is the embedding's transpose (no `lm_head`)."""
    attention_bias: Flag = False
    """Biases of the q, k and v projections (Qwen2.x; GPT-OSS: of q, k, v and o)."""
    qk_norm: Flag = False
    """A per-head RMSNorm of q and k (Qwen3, Gemma 3, Qwen3.5)."""
    max_position_embeddings: optional(Integer) = None
    """The context length config.json declares: read from it and written back (131072 when unset); it limits
    nothing in jlong, whose length is `train.seq_len`."""
    # Sliding-window attention (Gemma 3, GPT-OSS) and layer types.
    sliding_window: optional(PositiveInt) = None
    """The window of the `sliding_attention` layers: a token sees itself and the window - 1 tokens before it
    (Hugging Face's convention). A family without sliding layers refuses it."""
    layer_types: tuple[str, ...] | None = None
    """Each layer's type, first to last, as Hugging Face's `layer_types`: `full_attention`, and the family's
    others (`sliding_attention`: Gemma 3, GPT-OSS; `linear_attention`: Qwen3.5). Unset: the family's pattern
    (`sliding_window_pattern`, `full_attention_interval`). A family of one layer type refuses it."""
    sliding_window_pattern: optional(PositiveInt) = None
    """Gemma 3 without `layer_types`: every sliding_window_pattern-th layer is `full_attention`, the rest
    sliding."""
    rope_local_base_freq: optional(Number) = None
    """Gemma 3: the RoPE base of the sliding layers."""
    query_pre_attn_scalar: optional(Number) = None
    """Gemma 3: the query scale's denominator, queries scaled by query_pre_attn_scalar^-1/2; unset: `head_dim`."""
    partial_rotary_factor: optional(Number) = None
    """RoPE on the first partial_rotary_factor of each head's dimensions (Qwen3.5: 0.25); unset: all of them."""
    # Linear-attention layers: Qwen3.5's Gated DeltaNet, the "linear_attention" layers among layer_types.
    full_attention_interval: optional(PositiveInt) = None
    """Qwen3.5 without `layer_types`: every full_attention_interval-th layer is `full_attention`, the rest Gated
    DeltaNet (`linear_attention`)."""
    linear_num_key_heads: optional(PositiveInt) = None
    """Qwen3.5's Gated DeltaNet: key heads."""
    linear_num_value_heads: optional(PositiveInt) = None
    """Qwen3.5's Gated DeltaNet: value heads."""
    linear_key_head_dim: optional(PositiveInt) = None
    """Qwen3.5's Gated DeltaNet: each key head's size."""
    linear_value_head_dim: optional(PositiveInt) = None
    """Qwen3.5's Gated DeltaNet: each value head's size."""
    linear_conv_kernel_dim: optional(PositiveInt) = None
    """Qwen3.5's Gated DeltaNet: the kernel of the short causal convolution before the delta rule."""
    # Mixtures of experts (Qwen3-MoE, Qwen3.5-MoE, GPT-OSS).
    num_experts: optional(PositiveInt) = None
    """A mixture of experts: the experts of each layer (config.json may say `num_local_experts`)."""
    num_experts_per_tok: optional(PositiveInt) = None
    """A mixture of experts: the experts each token is routed to (GPT-OSS's config.json: `experts_per_token`)."""
    moe_intermediate_size: optional(PositiveInt) = None
    """Qwen3-MoE and Qwen3.5-MoE: each SwiGLU expert's inner size (GPT-OSS's experts are `intermediate_size`)."""
    norm_topk_prob: Flag = False
    """Renormalise each token's top-k router probabilities (Qwen3.5-MoE always does)."""
    decoder_sparse_step: optional(PositiveInt) = None
    """Qwen3-MoE: every decoder_sparse_step-th layer is a mixture, the others dense (an MLP of
    `intermediate_size`)."""
    mlp_only_layers: tuple[int, ...] | None = None
    """Qwen3-MoE: the layers (0-based) that are dense, an MLP of `intermediate_size`."""
    output_router_logits: Flag = False
    """Hugging Face's flag, read from and written to config.json; it decides nothing here: jlong trains the
    load-balancing loss by `train.router_aux_loss`."""
    router_aux_loss_coef: Number = 0.001
    """A mixture of experts' training loss adds router_aux_loss_coef x the load-balancing loss (as transformers
    computes it), unless `train.router_aux_loss=false`."""
    # GPT-OSS's experts: a clamped SwiGLU, (up + 1) x gate x sigmoid(swiglu_alpha x gate); their size is
    # intermediate_size, as in Hugging Face's config (its router and experts have biases, and attention a sink
    # logit per head).
    swiglu_limit: optional(PositiveNumber) = None
    """GPT-OSS: the clamped SwiGLU's limit, the gate clamped above at swiglu_limit and up to [-swiglu_limit,
    swiglu_limit]. Other families refuse it."""
    swiglu_alpha: optional(PositiveNumber) = None
    """GPT-OSS: the clamped SwiGLU's slope, (up + 1) x gate x sigmoid(swiglu_alpha x gate). Other families refuse
    it."""
    preset: optional(Text) = None
    """A model preset: a file of `configs/models/`, whose fields lie beneath the ones set inline."""
    hf_path: optional(Text) = None
    """A Hugging Face checkpoint directory: its config.json gives the model's fields (inline ones may not
    contradict its shapes) and its weights start the run (a LoRA run's frozen base). An image-text checkpoint
    (Gemma 3, Qwen3.5, Qwen3.5-MoE) is read as its text model, GPT-OSS's MXFP4 experts dequantized as
    transformers dequantizes them; what is left out is said in one line."""
    # Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash: `jlong.attention.latent`); head_dim is then the
    # query and key heads' size, qk_nope_head_dim + qk_rope_head_dim.
    q_lora_rank: optional(PositiveInt) = None
    """Latent attention: the compressed query's size; unset: queries projected from the input directly."""
    kv_lora_rank: optional(PositiveInt) = None
    """Latent attention: the compressed key-value latent's size, which every head's keys and values come from."""
    qk_nope_head_dim: optional(PositiveInt) = None
    """Latent attention: each query and key head's dimensions without rotary embedding."""
    qk_rope_head_dim: optional(PositiveInt) = None
    """Latent attention: each query head's rotary dimensions, and the size of the one rotary key all heads share."""
    v_head_dim: optional(PositiveInt) = None
    """Latent attention: each value head's size."""
    # DeepSeek's mixtures of experts.
    first_k_dense_replace: optional(NonNegativeInt) = None
    """DeepSeek: the first first_k_dense_replace layers are dense (an MLP of intermediate_size), the rest
    mixtures."""
    n_shared_experts: optional(PositiveInt) = None
    """DeepSeek: shared experts every token runs, one SwiGLU of n_shared_experts x moe_intermediate_size."""
    routed_scaling_factor: optional(PositiveNumber) = None
    """DeepSeek: what the routed experts' weights are multiplied by."""
    n_group: optional(PositiveInt) = None
    """DeepSeek: groups of experts; a token's experts come from its topk_group best groups."""
    topk_group: optional(PositiveInt) = None
    """DeepSeek: the groups a token's experts are chosen from."""
    topk_method: optional(Text) = None
    """DeepSeek-V2: `greedy` (the top experts) or `group_limited_greedy` (within the topk_group groups of the
    highest expert scores); DeepSeek-V3's and GLM's routing is `noaux_tc`."""

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
    """The device mesh: data x fsdp x ring x sp, whose product is the device count; each sequence is cut into
    ring x sp shards, one per device."""

    data: PositiveInt = 1
    """Data-parallel replicas: each holds the whole model and takes its share of the batch."""
    fsdp: PositiveInt = 1
    """Fully sharded data parallelism: parameters, gradients and optimizer state sharded over these devices,
    which also split the batch."""
    ring: PositiveInt = 1
    """Ring attention across this many groups of sp devices: keys and values pass to the next group around the
    ring (one neighbour, so transfers overlap the attention in hand). Use it across nodes, once one node's sp
    devices cannot hold the sequence, keeping sp = GPUs per node; a ring alone (sp = 1) only where the heads are
    too few to split over sp. Needs `attention.sp_method=ulysses`; train.seq_len a multiple of 2 x ring x sp, and
    a sliding window no longer than half a zigzag chunk (train.seq_len / (2 x ring))."""
    sp: PositiveInt = 1
    """Sequence parallelism within a group of sp devices (the first knob for long sequences: sp = GPUs per node,
    where the links are fast); `attention.sp_method` says how attention spans them. With `ulysses` sp must
    divide the attention heads."""

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.ring * self.sp

    @property
    def sequence_shards(self) -> int:
        """How many pieces each sequence is cut into, one per device: ring x sp."""
        return self.ring * self.sp


class AttentionConfig(_Section):
    """The attention kernel and how attention spans the sequence-parallel devices."""

    impl: Text = "auto"
    """The attention kernel: `auto` (chosen by platform and model), a kernel of `jlong.attention.kernels`, or
    `reference` (plain attention, for tests)."""
    sp_method: Text = "ulysses"
    """How attention spans the sp devices (`jlong.attention.methods`). `ulysses` (the default): heads exchanged
    all-to-all, each device attending the whole sequence for its share of the heads, with ring attention across
    `mesh.ring`; use it when sp divides the heads, and always with a ring. `allgather`: keys and values gathered
    over sp in head stages, each device attending its own queries over them (the Llama 3 paper's context
    parallelism); use it when sp does not divide the heads (40-head Qwen 2.5 on sp 16), or where GQA leaves so
    few kv heads that gathering them moves fewer bytes than Ulysses' all-to-alls of queries, keys, values and
    outputs (roughly: sp x kv heads < heads + kv heads); no ring, and a stage's gathered keys
    and values take the whole sequence on each device (layers with a sliding window receive only the
    neighbours' last window - 1 keys where the window fits in half a zigzag chunk). `jlong maxlen CONFIG
    --target h100 --fastest --search attention.sp_method=ulysses,allgather` ranks the two for a config."""
    heads_per_stage: Annotated[int | Literal["all", "auto"] | None, BeforeValidator(_heads_per_stage)] = None
    """The head stage size U. Unset: the method's default (Ulysses: `mesh.sp`; the all-gather: one kv head's
    query group); `all` (or 0): every head in one stage (plain Ulysses); `auto`: the largest stage whose plan
    fits, chosen with `memory.remat=auto` (`jlong.planner.memory_choice`)."""
    block_size: PositiveInt = DEFAULT_BLOCK_SIZE
    """The query and key block of the blockwise kernel."""
    max_documents: PositiveInt = DEFAULT_MAX_DOCUMENTS
    """Packed documents per sequence that cuDNN takes (it sizes cuDNN's statistics); a batch with more stops the
    run."""


class MemoryConfig(_Section):
    """What the backward pass keeps, recomputes or offloads to host memory, and the sequence tiles."""

    remat: choice(Literal[RematName, "auto"]) = "none"
    """What each layer keeps for the backward pass (the rest is recomputed), on the device or offloaded to host
    memory; `auto`: the planner chooses each layer's policy (and `layers_per_checkpoint`) to fill both budgets,
    and says why in `jlong plan` and `--dry-run` (`jlong.planner.memory_choice`)."""
    layers_per_checkpoint: PositiveInt = 1
    """k: with `save_inputs` / `offload_inputs`, one kept input per k layers."""
    remat_runs: Annotated[dict, BeforeValidator(_remat_runs)] = {}
    """The first layers in runs under policies of their own, in order, `{policy: layers, ...}`: for example
    `{save_attention: 1, offload_attention: 7}` keeps attention's outputs on the device for the first layer and
    in host memory for the next seven. The remaining layers follow `remat`; empty, every layer does."""
    optimizer_offload: Flag = False
    """Master parameters and AdamW moments in host memory."""
    mlp_tile: NonNegativeInt = 0
    """Tokens per tile of each device's sequence shard through the MLP; 0 = untiled."""
    loss_tile: NonNegativeInt = 0
    """Tokens per tile of each device's sequence shard through the output projection and the loss, so the whole
    logits never exist; 0 = untiled."""


class KernelsConfig(_Section):
    """The GPU kernels of the token and channel mixers; `auto` picks by platform (the GPU's own on a GPU)."""

    gated_delta: Text = "auto"
    """Gated DeltaNet's rule: `auto` (on a GPU, the first of `triton`, `triton_recurrence` and `mosaic` whose Pallas
    kernels a race has recorded running on a GPU, `jlong.kernel_runs`; `chunked` otherwise and elsewhere), or one
    of `jlong.linear_attention.gated_delta.KERNELS` by name (`mosaic`: Pallas Mosaic GPU for Hopper, bf16, widths
    multiples of 64; in a model on GPUs only); a GPU kernel chosen on the CPU runs in Pallas' interpreter (slow)."""
    grouped_matmul: Text = "auto"
    """The experts' grouped matmul: `auto` (on a GPU, the first of `triton` and `mosaic` whose kernels a race has
    recorded running on a GPU, `jlong.kernel_runs`; `ragged_dot` otherwise and elsewhere), or one of
    `jlong.moe.grouped_matmul.KERNELS` by name (`mosaic`: Pallas Mosaic GPU for Hopper, bf16 or f16); a GPU kernel
    chosen on the CPU runs in its interpreter (slow)."""


class TrainConfig(_Section):
    """The run's length and batch, the optimizer (AdamW, global-norm clipping, linear warmup then cosine decay),
    dtypes, the objective, and what each step logs."""

    steps: PositiveInt = 100
    """Optimizer steps of the run; the learning-rate schedule spans them."""
    seq_len: PositiveInt = 2048
    """Tokens per sequence: the context length trained."""
    batch_size: PositiveInt = 8
    """Global sequences per step."""
    lr: PositiveNumber = 3e-4
    """The peak learning rate: linear warmup from lr / warmup_steps to lr, then cosine decay to min_lr_ratio x lr
    at the last step."""
    min_lr_ratio: Number = 0.1
    """Where the cosine decay ends, as a share of lr."""
    warmup_steps: NonNegativeInt = 10
    """Steps of linear warmup."""
    weight_decay: NonNegativeNumber = 0.1
    """AdamW's decoupled weight decay, of the weight matrices only."""
    grad_clip: NonNegativeNumber = 1.0
    """The gradients' global norm is clipped to this; 0 = no clipping."""
    b1: Number = 0.9
    """AdamW's decay of the first moment."""
    b2: Number = 0.95
    """AdamW's decay of the second moment."""
    eps: Number = 1e-8
    """AdamW's epsilon."""
    seed: Integer = 0
    """The seed of the random initial parameters, synthetic data, shuffling and document sampling."""
    param_dtype: choice(DType) = "float32"
    """The dtype of the parameters between steps (and of the optimizer's state)."""
    compute_dtype: choice(DType) = "bfloat16"
    """The dtype the forward and backward passes compute in."""
    profile_start: Integer = 3
    """The first step of the `jax.profiler` trace window."""
    profile_steps: NonNegativeInt = 0
    """Steps to trace into run_dir/profile from `profile_start`; 0 = no trace."""
    gpu_memory_fraction: Annotated[float, BeforeValidator(_fraction)] = DEFAULT_GPU_MEMORY_FRACTION
    """The share of each GPU's memory the run asks XLA for (XLA_PYTHON_CLIENT_MEM_FRACTION); the planner's
    default device budget follows it. The rest is for what lives outside XLA's pool: the CUDA context,
    cuBLAS/cuDNN handles, NCCL's buffers."""
    eval_every: NonNegativeInt = 0
    """Steps between evaluations of the held-out loss by position on eval.path (or eval.mix), logged as
    `eval_loss` and `eval_loss_by_position`; 0 = none."""
    log_to: sequence_of(choice(Literal["jsonl", "tensorboard", "wandb"])) = ("jsonl",)
    """Where each step's metrics go besides run_dir/metrics.jsonl (always written: resuming and loss.png read
    it): `tensorboard`, event files in run_dir/tensorboard; `wandb`, Weights & Biases (`pip install
    'jlong[wandb]'`; offline with WANDB_MODE=offline)."""
    init_from: optional(Text) = None
    """Step 1 from these weights, with a fresh optimizer: a jlong checkpoint directory (of any mesh) or a Hugging
    Face one; the model's shapes must match."""
    check_host_memory: Flag = True
    """On a GPU, compare the step's host bytes on each node with the node's available memory before step 1, and
    stop when they do not fit."""
    router_aux_loss: Flag = True
    """A mixture of experts adds model.router_aux_loss_coef x the load-balancing loss to its training loss."""
    objective: choice(Literal["lm", "dpo", "grpo"]) = "lm"
    """`lm`: next-token cross-entropy; `dpo`: Direct Preference Optimization on preference pairs (`jlong prepare
    --preference`, data.sampling=pairs) against a reference policy (`jlong.objectives.dpo`); `grpo`: Group
    Relative Policy Optimization on rollouts of the `rl` section's prompts (`jlong.objectives.grpo`), which
    replace the data section."""
    dpo_beta: PositiveNumber = 0.1
    """DPO's beta: how far the policy may move from the reference."""


class RLConfig(_Section):
    """Reinforcement learning (`train.objective: grpo`): the prompts, the reward functions, the rollouts and TRL's
    GRPO loss, by TRL's names and defaults (`jlong.objectives.grpo`)."""

    prompts: optional(Text) = None
    """The prompts, in TRL's prompt-only format: JSON Lines, Parquet or a datasets directory of `prompt` (text or a
    conversation, rendered with data.tokenizer's chat template and its generation prompt) or `prompt_ids`; every
    other column is passed to the reward functions by name. Each step takes `prompts_per_step` of them in order."""
    rollouts: optional(Text) = None
    """Rollouts another engine wrote, in place of jlong's sampler: JSON Lines of `prompt_ids`, `completion_ids`,
    `logprobs` (the sampler's, of logits / rl.temperature: the old log-probabilities of the ratio, as they
    stand), `reward` (or one field per function of rl.rewards) and `group`; each step takes `prompts_per_step`
    groups in file order."""
    rewards: sequence_of(Text) = ()
    """Reward functions, called as TRL calls them: `module:function`, `path/to/file.py:function`, or a built-in
    (`exact_answer`: the final answer against an `answer` column; `think_format`), each giving one float (or
    None) per completion (`jlong.objectives.rewards`)."""
    reward_weights: optional(sequence_of(Number)) = None
    """Each reward function's weight in a completion's reward (default 1 each)."""
    num_generations: Integer = 8
    """G: completions per prompt, a group (at least 2)."""
    prompts_per_step: PositiveInt = 1
    """Prompts (groups) a step trains on; their G completions each must fit train.batch_size rows of
    train.seq_len."""
    max_new_tokens: PositiveInt = 256
    """The longest completion (TRL's max_completion_length); a prompt plus it must fit train.seq_len."""
    temperature: PositiveNumber = 1.0
    """The sampler's temperature; log-probabilities are of logits / temperature, in the rollouts and the loss."""
    top_p: Annotated[float, BeforeValidator(_fraction)] = 1.0
    """The sampler's top-p (1: every token)."""
    top_k: NonNegativeInt = 0
    """The sampler's top-k (0: every token)."""
    loss_type: choice(Literal["dapo", "grpo", "dr_grpo", "bnpo"]) = "dapo"
    """How the per-token loss is normalised, as TRL does on one process: `dapo` and `bnpo` by the batch's
    completion tokens, `grpo` each completion's mean then their mean, `dr_grpo` by the completions x
    max_new_tokens."""
    epsilon: PositiveNumber = 0.2
    """The ratio's lower clip: 1 - epsilon."""
    epsilon_high: optional(PositiveNumber) = None
    """The ratio's upper clip: 1 + epsilon_high (default: epsilon)."""
    beta: NonNegativeNumber = 0.0
    """The weight of the k3 estimate of KL to the reference policy (LoRA: the adapters off; otherwise the starting
    weights, a second copy on the devices); 0: no reference."""
    scale_rewards: choice(Literal["group", "batch", "none"]) = "group"
    """Advantages (r - the group's mean) divided by the group's standard deviation, the batch's, or nothing."""
    num_iterations: PositiveInt = 1
    """Steps each batch of rollouts serves, against the log-probabilities it was sampled with."""
    mask_truncated_completions: Flag = False
    """Completions cut at max_new_tokens (no stop id) carry no loss."""
    stop_ids: sequence_of(NonNegativeInt) = ()
    """Token ids that end a completion, beside the checkpoint's end-of-sequence ids."""
    export_every: NonNegativeInt = 0
    """Every this many steps, the weights (a LoRA run's merged) as a Hugging Face checkpoint in `export_dir`, for
    an engine that writes rl.rollouts to reload; 0: never."""
    export_dir: optional(Text) = None
    """Where `export_every` writes: the newest export replaces the one before, whole."""

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class LoraConfig(_Section):
    """LoRA: the base frozen, low-rank adapters trained on the linear layers `targets` names (`jlong.lora`)."""

    rank: PositiveInt = 16
    """The adapters' rank."""
    alpha: PositiveNumber = 16.0
    """The adapters' product is scaled by alpha / rank, as PEFT's lora_alpha."""
    targets: Annotated[tuple[str, ...], BeforeValidator(_targets)] = ("all-linear",)
    """PEFT's target_modules names (q_proj, down_proj, in_proj_qkv, ...), or `all-linear`: every linear layer of
    the layers (not the output layer, not a mixture's routed experts)."""
    base_dtype: choice(Literal["compute", "nf4"]) = "compute"
    """The frozen base: in train.compute_dtype (`compute`), or in 4-bit NormalFloat with blockwise scales
    (`nf4`: QLoRA)."""
    init_from: optional(Text) = None
    """A PEFT adapter directory to start the adapters from."""


Sampling = choice(Literal["windows", "documents", "pairs"])


class CorpusEntry(_Section):
    """One weighted token corpus of a mixture (`eval.mix`; `data.mix` adds sampling settings)."""

    path: Paths
    """A token file, a directory of shards, or a list of them."""
    weight: PositiveNumber = 1.0
    """Its share: weight / the sum of the weights."""
    name: optional(Text) = None
    """Its name in metrics (`tokens_by_source`, the loss by source); default: the path's stem."""
    eos_id: optional(Integer) = None
    """Its own end-of-document id (default: data.eos_id)."""

    @property
    def label(self) -> str:
        first = self.path if isinstance(self.path, str) else self.path[0]
        return self.name or Path(first).name.removesuffix(".npy") or first


class MixSource(CorpusEntry):
    """One source of `data.mix`; unset settings are data's own."""

    sampling: optional(Sampling) = None
    """Its data.sampling; unset: data's."""
    long_document_weight: optional(PositiveNumber) = None
    """Its data.long_document_weight; unset: data's."""
    shuffle: optional(Flag) = None
    """Its data.shuffle; unset: data's."""


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
    """The training data: synthetic tokens, a token file (or shards), or a weighted mixture of them, and how
    sequences are drawn from it."""

    tokenizer: optional(Text) = None
    """A tokenizer directory (or tokenizer.json) for what is read as text: GRPO's prompts, completions and reward
    functions."""
    source: choice(Literal["synthetic", "tokens"]) = "synthetic"
    """`synthetic`: random token ids, nothing to read; `tokens`: token files (`path` or `mix`)."""
    path: optional(Paths) = None
    """A 1-D integer .npy of token ids (`jlong prepare`), a directory of shards (`jlong prepare
    --shard-tokens`), or a list of them, read as one corpus."""
    mix: optional(sequence_of(Mapping)) = None
    """A weighted mixture of token corpora in place of path: a list of entries, each with the settings of
    `data.mix[]`."""
    shuffle: Flag = False
    """Each pass over the samples in its own seeded order; false: sample i is tokens[i*S : i*S + S + 1], step t
    taking samples (t-1)B to tB-1."""
    eos_id: optional(Integer) = None
    """Packed documents split at this id: attention and RoPE restart after each. Unset: the id `jlong prepare`
    recorded beside the token file, for document sampling and conversations (`jlong.data.recorded`)."""
    loss_mask: optional(Flag) = None
    """Train only the ids a token file's mask marks (`jlong prepare --chat`); unset: when the files have masks;
    false: every id."""
    sampling: Sampling = "windows"
    """`windows`: contiguous windows of the token file; `documents`: sequences packed from whole documents;
    `pairs`: whole preference pairs packed (`jlong prepare --preference`; the default of train.objective=dpo)."""
    long_document_weight: PositiveNumber = 1.0
    """With `documents`: how many times as often as the others a document of at least train.seq_len tokens is
    drawn (at least 1)."""

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
    """Evaluation (`jlong eval`, train.eval_every, a stage's end): the held-out loss by position, passkey
    retrieval, and answers generated for prompts and scored against theirs."""

    path: optional(Paths) = None
    """Held-out tokens (a .npy or shards, like data.path) for the loss by position."""
    mix: optional(sequence_of(Mapping)) = None
    """Held-out corpora in place of path, each scored on its own: a list of entries, each with the settings of
    `eval.mix[]`."""
    sequences: PositiveInt = 8
    """train.seq_len windows of held-out tokens to score (a mix: split by weight)."""
    passkey_trials: NonNegativeInt = 4
    """Passkey retrieval trials per (length, depth) cell; 0 = no passkey retrieval."""
    passkey_lengths: optional(sequence_of(PositiveInt)) = None
    """The passkey prompts' lengths in tokens; unset: seq_len/8, /4, /2 and seq_len."""
    passkey_depths: sequence_of(Annotated[float, BeforeValidator(_share)]) = (0.0, 0.25, 0.5, 0.75, 1.0)
    """Where the key sits in each prompt, as a share of its length (0: the start, 1: the end)."""
    passkey_digits: Annotated[int, BeforeValidator(_key_digits)] = 5
    """The key's length in digits; 1 asks for reach without copying a sequence."""
    tokenizer: optional(Text) = None
    """A Hugging Face tokenizer.json, or a directory holding one, for the passkey's text and the answers'
    prompts (a directory: its chat template renders conversations); unset: bytes."""
    answers_path: optional(Text) = None
    """Prompts whose generated answers are scored (RULER-style): JSON Lines (or Parquet, a datasets directory)
    of `prompt` (text or a conversation) or `prompt_ids`, and `answer`: a string the answer must equal (spaces
    around it aside), or a list of values it must hold (scored by the share it holds). Each prompt is completed
    greedily by the sampler (`jlong.generation`) up to `answers_max_new_tokens` or a stop id."""
    answers_max_new_tokens: PositiveInt = 32
    """The longest generated answer, in tokens."""
    stop_ids: sequence_of(NonNegativeInt) = ()
    """Token ids that end a generated answer, beside the checkpoint's end-of-sequence ids (its
    generation_config.json or config.json `eos_token_id`)."""

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
    """Where and how often the run saves itself; a run started again resumes from its newest checkpoint."""

    dir: optional(Text) = None
    """The checkpoint directory, resumed from when it holds this run's checkpoints; unset: none are written."""
    every: NonNegativeInt = 0
    """Steps between checkpoints; 0 = only at the end."""
    keep: PositiveInt = 2
    """How many of the newest checkpoints are kept."""


class Stage(_Section):
    """One stage of a run's length curriculum (`jlong.config.stages`)."""

    until_step: PositiveInt
    """The stage's last step."""
    set: Mapping = {}
    """Dotted keys -> values, over the run's config (for example `{train.seq_len: 65536}`)."""


class Config(_Section):
    """A run: one YAML file of these sections; any key can be overridden as `section.key=value`."""

    model: ModelConfig
    """The decoder's architecture: a preset, a Hugging Face checkpoint's config.json, or fields inline."""
    mesh: MeshConfig = Field(default_factory=MeshConfig)
    """The device mesh."""
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    """The attention kernel and sequence-parallel method."""
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    """Rematerialisation, host offload and sequence tiles."""
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    """The token and channel mixers' GPU kernels."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """The steps, batch, optimizer, dtypes and objective."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The training data."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoints and resuming."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out loss and passkey retrieval."""
    lora: LoraConfig | None = None
    """LoRA / QLoRA fine-tuning; absent: every parameter trains."""
    rl: RLConfig = Field(default_factory=RLConfig)
    """Reinforcement learning's prompts, rewards and loss (`train.objective: grpo`)."""
    run_dir: optional(Text) = None
    """The run directory: metrics.jsonl (one JSON object per step), config.yaml, loss.png (the loss of every step
    so far), and tensorboard/ and profile/ when asked for; unset: none is written."""
    stages: tuple[Stage, ...] = ()
    """A curriculum in one run: a list of `{until_step: N, set: {dotted.key: value, ...}}`, in order, the last
    ending at train.steps (`jlong.config.stages`)."""

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
