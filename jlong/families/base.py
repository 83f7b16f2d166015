"""A model family: everything jlong knows about one architecture, in one
object that the rest of jlong asks.

- its config: defaults its Hugging Face config implies, and its own checks;
- its parameter layout: each parameter's shape, logical axes and role
  (`jlong.families.params`), layer parameters without the `layers` axis the
  model stacks them on;
- its maths: the decoder block (norm placement, attention, MLP and its
  activation, the residual epilogue), the final norm, any scaling of the
  embeddings, and each layer's type (`layer_types`: layers of one type share
  a sliding window and RoPE; the model scans each run of one type);
- its FLOPs per token, the convention MFU is quoted in;
- its Hugging Face form: reading and writing config.json, and each
  parameter's tensor name and layout.

A new family subclasses `Family` (or an existing family) and is registered
(`jlong.families.register`); `model.family` names it, as Hugging Face's
`model_type` does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from jlong.errors import JlongError
from jlong.families import blocks
from jlong.families.params import ParamSpec, Role

if TYPE_CHECKING:
    from jlong.attention.methods import SequenceParallelMethod
    from jlong.config import Config, ModelConfig

# The Hugging Face config.json keys that are jlong `model` fields by the same name.
SHARED_HF_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
)


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One parameter's Hugging Face tensor (or tensors): its name (for a layer
    parameter, what follows `model.layers.{i}.`) and the layout changes both ways."""

    name: str
    to_jlong: Callable = lambda w: w
    to_hf: Callable = lambda w: w
    # > 0: the parameter's leading axis is this many tensors, one per entry (a mixture's experts), each
    # named by `name` with `{part}` its index and laid out by to_jlong / to_hf.
    parts: int = 0
    # Where to_hf reorders the output axes (their flattened index): Hugging Face's output row i is jlong's
    # output output_order[i]; None: in jlong's order. PEFT's lora_B rows follow it (`jlong.lora.peft_format`).
    output_order: tuple[int, ...] | None = None

    def part_names(self, prefix: str = "") -> list[str]:
        """The tensor names of one parameter (of one layer, after `prefix`)."""
        if not self.parts:
            return [prefix + self.name]
        return [prefix + self.name.format(part=part) for part in range(self.parts)]


TRANSPOSED = {"to_jlong": lambda w: w.T, "to_hf": lambda w: w.T}


def hf_projection_tensors(model: ModelConfig) -> dict[str, HFTensor]:
    """The attention and gated-MLP matrices' tensors (`params.attention_matrices`,
    `params.gated_mlp_matrices`) as Llama, Qwen and Gemma name them."""
    D, H, K, d = model.hidden_size, model.num_attention_heads, model.kv_heads, model.dim_per_head

    def in_heads(name, n):  # HF linear weights are [out, in]; jlong keeps [in, heads, head_dim]
        return HFTensor(name, lambda w: w.T.reshape(D, n, d), lambda w: w.reshape(D, n * d).T)

    return {
        "wq": in_heads("self_attn.q_proj.weight", H),
        "wk": in_heads("self_attn.k_proj.weight", K),
        "wv": in_heads("self_attn.v_proj.weight", K),
        "wo": HFTensor("self_attn.o_proj.weight", lambda w: w.T.reshape(H, d, D), lambda w: w.reshape(H * d, D).T),
        "w_gate": HFTensor("mlp.gate_proj.weight", **TRANSPOSED),
        "w_up": HFTensor("mlp.up_proj.weight", **TRANSPOSED),
        "w_down": HFTensor("mlp.down_proj.weight", **TRANSPOSED),
    }

FULL_ATTENTION = "full_attention"  # Hugging Face's name for a layer that sees every earlier token


def mean_visible_keys(seq_len: int, window: int = 0) -> float:
    """Keys a query sees on average in causal attention over `seq_len` tokens:
    half the sequence (the convention MFU is quoted in), or within a window
    of w tokens, min(p + 1, w) averaged over positions p."""
    if not window or window >= seq_len:
        return seq_len / 2
    return window - window * (window - 1) / (2 * seq_len)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # `model.family`, and Hugging Face's model_type
    hf_architecture: str  # the transformers class with exactly this architecture

    # ---------------------------------------------------------------- config

    def config_defaults(self) -> dict[str, Any]:
        """`model` fields this family implies unless a config sets them."""
        return {}

    def check(self, model: ModelConfig) -> None:
        """Raises a one-line `JlongError` for a model this family cannot be."""

    # ---------------------------------------------------------------- layout

    def layer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        raise NotImplementedError

    def outer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        """The parameters outside the layers: embedding, final norm, output projection."""
        V, D = model.vocab_size, model.hidden_size
        specs = {
            "embed": ParamSpec((V, D), ("vocab", "embed"), Role.EMBEDDING),
            "final_norm": ParamSpec((D,), ("embed",), Role.NORM),
        }
        if not model.tie_word_embeddings:
            specs["lm_head"] = ParamSpec((D, V), ("embed", "vocab"), Role.EMBEDDING)
        return specs

    def roles(self, model: ModelConfig) -> dict[str, Role]:
        """Each parameter's role, by its leaf's name (names are unique across the whole dict)."""
        specs = {**self.outer_params(model), **self.layer_params(model)}
        return {name: spec.role for name, spec in specs.items()}

    def decay_mask(self, model: ModelConfig, params) -> dict:
        """True for each leaf of `params` (the whole dict or any part of it) that AdamW decays."""
        role = self.roles(model)
        return jax.tree_util.tree_map_with_path(lambda path, _: role[path[-1].key].decays, params)

    # ---------------------------------------------------------------- maths

    def block(self, p, x_BSD, positions_BS, segment_ids_BS, model: ModelConfig, options):
        """One decoder layer: [B, S, D] -> [B, S, D] with the layer's parameters `p` by name."""
        raise NotImplementedError

    def final_norm(self, x_BSD, weight, model: ModelConfig, options):
        return blocks.sequence_norm(x_BSD, weight, model, options)

    def scale_embeddings(self, x_BSD, model: ModelConfig):
        """The token embeddings as the first layer takes them."""
        return x_BSD

    def layer_types(self, model: ModelConfig) -> tuple[str, ...]:
        """Each layer's type, first to last (Hugging Face's `layer_types`)."""
        return (FULL_ATTENTION,) * model.num_hidden_layers

    def attention_window(self, model: ModelConfig, layer_type: str) -> int:
        """The sliding window of layers of `layer_type`: a token sees itself and
        the window - 1 tokens before it; 0, every earlier token."""
        return 0

    def attention_sinks(self, model: ModelConfig) -> bool:
        """Whether its attention has sinks (`QKVProjection.sinks`): `attention.impl=auto` then chooses
        among the kernels that run them."""
        return False

    @property
    def known_layer_types(self) -> tuple[str, ...]:
        """Every layer type this family has a block for."""
        return (FULL_ATTENTION,)

    def check_layer_types(self, model: ModelConfig, label: str) -> None:
        """One-line errors for layer types that do not name every layer or that
        this family (`label` in the error) has no block for."""
        layer_types = self.layer_types(model)
        if len(layer_types) != model.num_hidden_layers:
            raise JlongError(f"model.layer_types names {len(layer_types)} layers, but model.num_hidden_layers is "
                             f"{model.num_hidden_layers}")
        if unknown := sorted(set(layer_types) - set(self.known_layer_types)):
            raise JlongError(f"model.layer_types: {', '.join(unknown)} is not a {label} layer type "
                             f"({' or '.join(self.known_layer_types)})")

    def check_layout(self, model: ModelConfig) -> None:
        """One-line errors for a parameter of no elements: above all a layer type whose parameters every model
        has but no layer is of (2 layers of Qwen3.5 with a full-attention layer every 4th), named with a
        layer count that has every type."""
        layer_specs = self.layer_params(model)
        specs = {**self.outer_params(model), **layer_specs}
        if empty := [name for name, spec in specs.items() if 0 in spec.shape]:
            raise JlongError(f"model.family={self.name}: parameter {empty[0]} has no elements (shape "
                             f"{specs[empty[0]].shape}): check the model's sizes")
        needed = {spec.layer_type for spec in layer_specs.values() if spec.layer_type is not None}
        if not (missing := sorted(needed - set(self.layer_types(model)))):
            return
        names = [name for name, spec in layer_specs.items() if spec.layer_type == missing[0]]
        what = (f"model.family={self.name} no {missing[0]} layer, which its parameters {', '.join(names[:3])}, ... "
                "belong to (they would have no elements)")
        if model.layer_types is not None:
            raise JlongError(f"model.layer_types gives {what}: name at least one {missing[0]} layer")
        layers = model.num_hidden_layers
        workable = next((n for n in range(layers + 1, layers + 1000) if needed <= set(
            self.layer_types(model.model_copy(update={"num_hidden_layers": n})))), None)
        fix = f": use model.num_hidden_layers={workable}, the fewest that has every layer type" if workable else ""
        raise JlongError(f"model.num_hidden_layers={layers} gives {what}{fix}")

    def layers_with(self, model: ModelConfig, spec: ParamSpec) -> int:
        """How many layers have a layer parameter: every layer, or those of its type."""
        if spec.layer_type is None:
            return model.num_hidden_layers
        return self.layer_types(model).count(spec.layer_type)

    def stack_index(self, model: ModelConfig, layer_type: str | None, layer: int) -> int:
        """Where layer `layer` is in the stack of an array stacked over the layers of `layer_type` (None: every
        layer), such as a parameter only those layers have."""
        if layer_type is None:
            return layer
        return self.layer_types(model)[:layer].count(layer_type)

    def layer_runs(self, model: ModelConfig) -> list[tuple[str, int]]:
        """The layers as runs of one type, first to last: (type, layers)."""
        return [(kind, len(list(run))) for kind, run in itertools.groupby(self.layer_types(model))]

    def windows(self, model: ModelConfig) -> set[int]:
        """The sliding windows its layers use (without 0)."""
        return {w for kind in set(self.layer_types(model)) if (w := self.attention_window(model, kind))}

    def scanned_runs(self, model: ModelConfig, first: int = 0) -> list[int]:
        """The lengths of the layer loops' bodies from layer `first` on (after memory.remat_runs'): the layers'
        period where their types repeat (one loop over the periods, `jlong.model.transformer.layer_groups`),
        else each run of one type; memory.layers_per_checkpoint must divide every one."""
        kinds = self.layer_types(model)[first:]
        period = shortest_period(kinds)
        if 1 < period < len(kinds):
            return [period]
        runs, start = [], 0
        for _, layers in self.layer_runs(model):
            if start + layers > first:
                runs.append(start + layers - max(start, first))
            start += layers
        return runs

    def attention_projection(self, model: ModelConfig):
        """The projection of the model's attention (`QKVProjection` unless a family makes its own)."""
        return blocks.projection_of(model)

    def check_parallel(self, config: Config, method: SequenceParallelMethod) -> None:
        """One-line errors for a model that the run's sequence-parallel method cannot run on its mesh: the
        method and kernel must run the attention's sinks where it has them; sliding windows run in Ulysses'
        stages, on a ring's halos (`jlong.attention.sliding`), where a window must fit in half a zigzag chunk,
        and as a band on the all-gather's keys, any window."""
        if self.attention_sinks(config.model):
            method.check_sinks(config.attention.impl)
        window = max(self.windows(config.model), default=0)
        if not window:
            return
        if not method.sliding_windows:
            raise JlongError(f"attention.sp_method={config.attention.sp_method} has no sliding windows, which "
                             f"model.family={self.name} has: use attention.sp_method=ulysses")
        if (ranks := config.mesh.ring) > 1 and window > (chunk := config.train.seq_len // (2 * ranks)):
            raise JlongError(f"model.sliding_window ({window}) is longer than the {chunk} tokens of each zigzag "
                             "chunk (train.seq_len / (2 x mesh.ring)): use a longer train.seq_len or a smaller ring")

    def matmul_params_per_token(self, model: ModelConfig) -> float:
        """The matrix parameters each token is multiplied by: every layer's
        matrices (those of its own type), of a mixture's experts only the
        share a token is routed to (num_experts_per_tok of num_experts), and
        the output projection."""
        total = model.hidden_size * model.vocab_size
        for spec in self.layer_params(model).values():
            if spec.role is Role.MATRIX:
                routed = model.num_experts_per_tok / model.num_experts if spec.axes[0] == "experts" else 1
                total += math.prod(spec.shape) * self.layers_with(model, spec) * routed
        return total

    def flops_per_token(self, model: ModelConfig, seq_len: int) -> float:
        """Model FLOPs per training token: 6 x matmul parameters (forward 2,
        backward 4: `matmul_params_per_token`), plus causal attention (QK^T
        and PV: 4 x d per head and visible key forward, x3 with the backward
        pass; a query sees half the sequence on average, or what its layer's
        window lets it, `mean_visible_keys`). Recomputation is not counted."""
        per_key = 12 * model.num_attention_heads * model.dim_per_head
        attention = sum(per_key * mean_visible_keys(seq_len, self.attention_window(model, kind))
                        for kind in self.layer_types(model))
        return 6 * self.matmul_params_per_token(model) + attention

    # ---------------------------------------------------------------- Hugging Face

    def hf_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """The jlong `model` fields a Hugging Face config.json (`hf`, read
        from `where`) describes. Reads both config forms: transformers 4
        (`rope_theta`, `rope_scaling`) and 5 (`rope_parameters`)."""
        if hf.get("mlp_bias"):
            raise JlongError(f"{where}: mlp_bias=true is not supported")
        rope = dict(hf.get("rope_parameters") or {})
        theta = hf.get("rope_theta", rope.pop("rope_theta", 10000.0))
        scaling = hf.get("rope_scaling") or rope or None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" \
                and scaling.get("original_max_position_embeddings") is None:  # as transformers reads it
            original = hf.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
            scaling = {**scaling, "original_max_position_embeddings": original}
        fields = {key: hf[key] for key in SHARED_HF_KEYS if hf.get(key) is not None}
        fields.update(family=self.name, rope_theta=float(theta), rope_scaling=scaling,
                      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)))
        return fields

    def hf_left_out(self, hf: dict[str, Any]) -> list[str]:
        """What of a Hugging Face checkpoint jlong reads past, each said in a note."""
        return []

    def hf_config(self, model: ModelConfig) -> dict[str, Any]:
        """config.json in the transformers 4 form, which both generations load."""
        return {
            "architectures": [self.hf_architecture],
            "model_type": self.name,
            "vocab_size": model.vocab_size,
            "hidden_size": model.hidden_size,
            "intermediate_size": model.intermediate_size,
            "num_hidden_layers": model.num_hidden_layers,
            "num_attention_heads": model.num_attention_heads,
            "num_key_value_heads": model.kv_heads,
            "head_dim": model.dim_per_head,
            "max_position_embeddings": model.max_position_embeddings or 131072,
            "rms_norm_eps": model.rms_norm_eps,
            "rope_theta": model.rope_theta,
            "rope_scaling": model.rope_scaling,
            "tie_word_embeddings": model.tie_word_embeddings,
            "initializer_range": 0.02,
            "torch_dtype": "float32",
        }

    def hf_layer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        """Each layer parameter's tensor within `model.layers.{i}.`."""
        raise JlongError(f"model family {self.name!r} has no Hugging Face tensor names")

    def hf_outer_tensors(self, model: ModelConfig) -> dict[str, HFTensor]:
        tensors = {"embed": HFTensor("model.embed_tokens.weight"), "final_norm": HFTensor("model.norm.weight")}
        if not model.tie_word_embeddings:
            tensors["lm_head"] = HFTensor("lm_head.weight", **TRANSPOSED)
        return tensors


@dataclasses.dataclass(frozen=True)
class OffsetNormFamily(Family):
    """A family whose RMSNorm weights are kept as offsets from one, x * (1 +
    w) (Hugging Face's Gemma and Qwen3.5): the final norm's too."""

    def outer_params(self, model: ModelConfig) -> dict[str, ParamSpec]:
        specs = super().outer_params(model)
        return {**specs, "final_norm": dataclasses.replace(specs["final_norm"], role=Role.NORM_OFFSET)}

    def final_norm(self, x_BSD, weight, model: ModelConfig, options):
        return super().final_norm(x_BSD, blocks.offset_scale(weight), model, options)


def shortest_period(items) -> int:
    """The fewest leading items that, repeated, make up `items` (their length when they do not repeat)."""
    n = len(items)
    return next(p for p in range(1, n + 1) if n % p == 0 and all(items[i] == items[i % p] for i in range(n)))


def every_nth_layer(model: ModelConfig, every: int, kind: str, other: str) -> tuple[str, ...]:
    """Layer types with every `every`-th layer of type `kind`, the rest `other`."""
    return tuple(kind if (i + 1) % every == 0 else other for i in range(model.num_hidden_layers))
