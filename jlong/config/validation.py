"""The configuration's rules that a single field cannot state: the model's
own consistency (its family's checks: its shapes, every layer type its
parameters need), and the rules that join sections: the sequence-parallel
method's (heads and lengths over the mesh, and the kernel; checked first: no
sequence length helps heads that sp cannot split), what the model needs of
that method (sliding windows, linear attention), the batch over data x
fsdp, lengths over tiles, layer groups.

The family and the method are the registered ones (`jlong.config.registry`):
each checks its own requirements; this module only calls them, in order.
Each raises a `JlongError` whose one line names the keys and a fix.
"""

from __future__ import annotations

from jlong.config.registry import FAMILIES, SP_METHODS
from jlong.errors import JlongError

# `Config` and `ModelConfig` (`jlong.config.schema`, whose validators call these checks) are named in the
# annotations without an import, which would close a circle: schema -> validation -> schema.

# The RoPE scaling methods jlong computes as Hugging Face does, and the keys each needs.
ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}

# Fields only some families read (those whose defaults name them); any other family refuses them.
FAMILY_OWN_FIELDS = ("swiglu_limit", "swiglu_alpha")


def with_family(values: dict) -> dict:
    """A `model` section's values with `family` resolved and the family's
    defaults beneath them: `family` if set, else Hugging Face's `model_type`
    (presets and config.json files name it so), else, for configs written
    before either was recorded, what the flags imply (qk_norm: qwen3,
    attention_bias: qwen2, neither: llama)."""
    values = dict(values)
    model_type = values.pop("model_type", None)
    family = values.get("family") or model_type
    if family is None:
        family = "qwen3" if values.get("qk_norm") else "qwen2" if values.get("attention_bias") else "llama"
    if not isinstance(family, str):
        raise JlongError(f"model.family must be a name, got {family!r}")
    return {**FAMILIES.named(family).config_defaults(), **values, "family": family}


def check_model(m: ModelConfig) -> None:
    family = FAMILIES.named(m.family)
    family.check(m)
    if m.sliding_window and not any(family.attention_window(m, kind) for kind in family.known_layer_types):
        raise JlongError(f"model.sliding_window is not part of model.family={m.family} "
                         "(a family with sliding-window layers reads it, gemma3_text for one)")
    for key in FAMILY_OWN_FIELDS:
        if getattr(m, key) is not None and key not in family.config_defaults():
            raise JlongError(f"model.{key} is not part of model.family={m.family} (gpt_oss's clamped SwiGLU "
                             f"experts read it): drop model.{key}")
    if m.layer_types and len(family.known_layer_types) == 1:
        raise JlongError(f"model.layer_types is not part of model.family={m.family} (its layers are all "
                         f"{family.known_layer_types[0]}; gemma3_text and qwen3_5_text have layers of several types)")
    if m.num_attention_heads % m.kv_heads:
        raise JlongError(
            f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
            f"model.num_key_value_heads ({m.kv_heads})"
        )
    if m.dim_per_head <= 0:
        raise JlongError(f"model.head_dim must be positive, got {m.dim_per_head}")
    if m.dim_per_head % 2:
        raise JlongError(f"model.head_dim must be even for rotary embeddings, got {m.dim_per_head}")
    if m.rotary_dims % 2 or not m.rotary_dims:
        raise JlongError(f"model.partial_rotary_factor ({m.partial_rotary_factor}) must leave an even, positive "
                         f"number of rotated dimensions of the {m.dim_per_head} per head, got {m.rotary_dims}")
    if m.rope_scaling is not None:
        _check_rope_scaling(m.rope_scaling)
    family.check_layout(m)


def _check_rope_scaling(scaling: dict) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return
    if kind not in ROPE_KEYS:
        raise JlongError(f"model.rope_scaling.rope_type {kind!r} is not supported; use one of "
                         f"{', '.join(ROPE_KEYS)} or null")
    missing = [k for k in ROPE_KEYS[kind] if scaling.get(k) is None]
    if missing:
        raise JlongError(f"model.rope_scaling ({kind}) lacks {', '.join(missing)}")
    if not scaling["factor"] >= 1:
        raise JlongError(f"model.rope_scaling.factor ({scaling['factor']}) must be at least 1")


def check_run(config: Config) -> None:
    method = SP_METHODS.named(config.attention.sp_method)
    method.check_kernel(config)
    method.check(config)  # heads, lengths and chunks over the mesh
    family = FAMILIES.named(config.model.family)
    family.check_parallel(config, method)  # what the model needs of the method: windows, linear attention
    if config.train.profile_steps and not config.run_dir:
        raise JlongError("train.profile_steps writes its trace into run_dir: set run_dir")
    _check_batch_split(config)
    _check_tiles(config)
    _check_layer_groups(config)
    _check_eval(config)
    _check_eos_id(config)
    _check_lora(config)
    _check_objective(config)


def _check_objective(config: Config) -> None:
    pairs, dpo = config.data.sampling == "pairs", config.train.objective == "dpo"
    if dpo and not pairs:
        raise JlongError(f"train.objective=dpo trains on whole preference pairs: data.sampling must be pairs, "
                         f"got {config.data.sampling}")
    if pairs and not dpo:
        raise JlongError("data.sampling=pairs reads preference pairs, which train.objective=dpo trains on: set it")
    if dpo and config.data.mix is not None:
        raise JlongError("train.objective=dpo reads one preference file (data.path), not data.mix")
    if config.train.objective == "grpo":
        _check_rl(config)


def _check_rl(config: Config) -> None:
    """GRPO's settings among themselves and against the run's length (the prompts' lengths are checked as
    they are read)."""
    rl = config.rl
    if rl.num_generations < 2:
        raise JlongError(f"rl.num_generations must be at least 2 (a group's advantages compare its completions), "
                         f"got {rl.num_generations}")
    if (rl.prompts is None) == (rl.rollouts is None):
        raise JlongError("train.objective=grpo takes its prompts from rl.prompts (jlong's sampler) or its rollouts "
                         "from rl.rollouts (another engine's): set one of them")
    if rl.prompts is not None and not rl.rewards:
        raise JlongError("rl.prompts are scored by reward functions: set rl.rewards (e.g. [exact_answer] or "
                         "[my_rewards.py:score])")
    if rl.max_new_tokens >= config.train.seq_len:
        raise JlongError(f"rl.max_new_tokens ({rl.max_new_tokens}) leaves no room for a prompt in train.seq_len "
                         f"({config.train.seq_len})")
    if rl.export_every and not rl.export_dir:
        raise JlongError("rl.export_every writes the weights into rl.export_dir: set it")


def _check_lora(config: Config) -> None:
    if config.lora is None:
        return
    if config.memory.optimizer_offload:
        raise JlongError("memory.optimizer_offload keeps every parameter's AdamW state in host memory; a LoRA run "
                         "trains only its adapters, whose state is small: drop memory.optimizer_offload")
    if config.train.init_from:
        raise JlongError("train.init_from starts every weight; a LoRA run's frozen base is model.hf_path (or the "
                         "seed) and its adapters start from lora.init_from. To adapt a model jlong trained, convert "
                         "its checkpoint to a Hugging Face directory ('jlong convert CHECKPOINT_DIR HF_DIR') and set "
                         "model.hf_path=HF_DIR in place of train.init_from")


def _check_batch_split(config: Config) -> None:
    mesh, batch = config.mesh, config.train.batch_size
    if batch % (mesh.data * mesh.fsdp):
        raise JlongError(
            f"train.batch_size ({batch}) must be a multiple of mesh.data x mesh.fsdp "
            f"({mesh.data * mesh.fsdp}): each of those ranks takes whole sequences"
        )


def _check_tiles(config: Config) -> None:
    """Tiles cut each device's shard of seq_len / (ring x sp) tokens evenly."""
    local = config.shard_tokens
    for key in ("mlp_tile", "loss_tile"):
        tile = getattr(config.memory, key)
        if tile and local % tile:
            divisors = [t for t in range(1, local + 1) if local % t == 0]
            nearest = sorted(divisors, key=lambda t: abs(t - tile))[:2]
            raise JlongError(
                f"memory.{key} ({tile}) must divide the {local} tokens each device holds "
                f"(train.seq_len / (mesh.ring x mesh.sp)); nearest that work: {', '.join(map(str, sorted(nearest)))}"
            )


def _check_layer_groups(config: Config) -> None:
    memory, layers = config.memory, config.model.num_hidden_layers
    in_runs = sum(memory.remat_runs.values())
    if in_runs >= layers:
        raise JlongError(f"memory.remat_runs covers {in_runs} of the {layers} layers: leave some to memory.remat "
                         "(a policy for every layer is memory.remat alone)")
    k, rest, remat = memory.layers_per_checkpoint, layers - in_runs, memory.remat
    if remat == "auto" and in_runs:
        raise JlongError("memory.remat=auto chooses memory.remat_runs itself: drop memory.remat_runs, or name a "
                         "policy in memory.remat to pin the runs you gave")
    if k > 1 and remat not in ("save_inputs", "offload_inputs", "auto"):
        raise JlongError(
            f"memory.layers_per_checkpoint={k} groups the layer inputs that memory.remat keeps: "
            f"use it with memory.remat=save_inputs or offload_inputs (got {remat})"
        )
    if rest % k:
        workable = [g for g in range(1, rest + 1) if rest % g == 0]
        after = " after memory.remat_runs'" if in_runs else ""
        raise JlongError(
            f"memory.layers_per_checkpoint ({k}) must divide the {rest} layers{after}; "
            f"values that work: {', '.join(map(str, workable))}"
        )
    runs = FAMILIES.named(config.model.family).scanned_runs(config.model, in_runs)
    if k > 1 and any(run % k for run in runs):
        raise JlongError(f"memory.layers_per_checkpoint ({k}) must divide each run of layers of one type, or their "
                         "period where their types repeat "
                         f"({', '.join(map(str, runs))} layers in model.family={config.model.family})")


def _check_eos_id(config: Config) -> None:
    vocab = config.model.vocab_size
    named = [("data.eos_id", config.data.eos_id)]
    for section in ("data", "eval"):
        entries = getattr(config, section).mix_sources
        named += [(f"{section}.mix[{i}].eos_id", entry.eos_id) for i, entry in enumerate(entries)]
    for key, eos_id in named:
        if eos_id is not None and not 0 <= eos_id < vocab:
            raise JlongError(f"{key} ({eos_id}) is outside the model's vocabulary (ids 0-{vocab - 1}); "
                             "give the end-of-document id 'jlong prepare' printed")


def _check_eval(config: Config) -> None:
    if config.train.eval_every and not config.eval.held_out:
        raise JlongError("train.eval_every scores held-out tokens: set eval.path (a .npy made by 'jlong prepare') "
                         "or eval.mix")
    named_eos = [i for i, entry in enumerate(config.eval.mix_sources) if entry.eos_id is not None]
    if named_eos and config.data.eos_id is None:
        raise JlongError(f"eval.mix[{named_eos[0]}].eos_id needs data.eos_id set too (it turns on document masking)")
    if config.train.eval_every and not config.run_dir:
        raise JlongError("train.eval_every logs into run_dir/metrics.jsonl: set run_dir")
    if set(config.train.log_to) - {"jsonl"} and not config.run_dir:
        raise JlongError(f"train.log_to {list(config.train.log_to)} writes into run_dir (TensorBoard's event files, "
                         "W&B's offline runs): set run_dir")
    too_long = [n for n in config.eval.passkey_lengths or () if n > config.train.seq_len]
    if too_long:
        raise JlongError(f"eval.passkey_lengths {too_long} exceed train.seq_len ({config.train.seq_len}): "
                         "the passkey prompts run in the run's sequences")
