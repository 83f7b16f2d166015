"""The decoder-only transformer in Flax NNX: embedding, the layers of its
family (`jlong.families`: Llama 3.x, Qwen 2.5, Qwen 3, ...), the final norm
and the output projection with its loss.

Layer parameters are stacked along a leading `layers` axis and the layers run
as one `lax.scan`, so XLA compiles a single layer whatever the depth; a
family whose layers differ (Gemma 3's sliding and global layers) or a run of
layers under a remat policy of its own gets one scan per run. Every
parameter carries the logical axis names of its dimensions (`axes` metadata);
`jlong.parallel.placement` maps those names to mesh axes.

Weights keep the head axis explicit (q projection [D, H, d], output
projection [H, d, D]) so attention can take any subset of heads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jlong.attention.kernels import AttentionKernel, choose_kernel
from jlong.attention.methods import SequenceParallelMethod, method_of
from jlong.attention.methods.ulysses import ULYSSES
from jlong.config import Config, ModelConfig
from jlong.errors import JlongError
from jlong.families import ParamSpec, family_of
from jlong.families.base import FULL_ATTENTION, shortest_period
from jlong.linear_attention import gated_delta
from jlong.lora.nf4 import dequantize, is_quantized
from jlong.lora.targets import LoraSettings, adapted_layer, adapter_specs
from jlong.model.layer_io import LayerIO
from jlong.model.document_sums import document_logps
from jlong.model.loss import cross_entropy, output_logits, target_logprobs, tiled_cross_entropy, token_scores
from jlong.model.remat import remat_policy, scan_layers, scan_periods
from jlong.moe import grouped_matmul
from jlong.moe.routing import expert_load_max_over_mean, load_balancing_loss
from jlong.ops.shards import HIDDEN, OneDevice, Shards
from jlong.options import DType, RematName, RematSegment


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How the forward pass computes; none of it changes the parameters."""

    shards: Shards = OneDevice()  # the devices the arrays are split over, as the model sees them
    sequence_parallel: SequenceParallelMethod = ULYSSES  # how attention spans the sp devices
    compute_dtype: DType = "float32"
    attention: AttentionKernel = AttentionKernel()
    head_stages: int = 1  # UPipe: the query heads run in this many stages of U = H / head_stages heads
    remat: RematName = "none"  # the `jlong.model.remat` policy of each layer
    layers_per_checkpoint: int = 1  # k: the policy keeps one input per k layers
    # Runs of layers under policies of their own (`Config.remat_segments`); () = every layer under `remat`.
    remat_segments: tuple[RematSegment, ...] = ()
    mlp_tile: int = 0  # tokens per sequence tile of the MLP on each device; 0 = untiled
    loss_tile: int = 0  # the same for the output projection and the loss
    layer_type: str = FULL_ATTENTION  # the type of the layers being run (`Family.layer_types`)
    grouped_matmul: str = "ragged_dot"  # a mixture of experts' kernel (`jlong.moe.grouped_matmul.KERNELS`)
    gated_delta: str = "chunked"  # Gated DeltaNet's rule (`jlong.linear_attention.gated_delta.KERNELS`)
    interpret_kernels: bool = False  # GPU kernels run in their interpreter (chosen on the CPU)
    router_aux_loss: bool = False  # a mixture of experts' loss adds router_aux_loss_coef x the load-balancing loss

    @property
    def unroll_attention_stages(self) -> bool:
        """Whether attention's head stages run unrolled rather than as a loop:
        under a policy that moves their saved outputs to host memory
        (`jlong.attention.methods.ulysses`)."""
        return remat_policy(self.remat).offloads_attention

    @classmethod
    def for_training(cls, config: Config, shards: Shards, platform: str) -> ForwardOptions:
        """The forward pass a run's config asks for on its mesh (`shards`) of
        `platform` ("gpu" or "cpu"), where `attention.impl=auto` becomes the
        kernel that platform runs."""
        method = method_of(config)
        return cls(
            shards=shards,
            sequence_parallel=method,
            compute_dtype=config.train.compute_dtype,
            attention=AttentionKernel(
                choose_kernel(
                    config.attention.impl, platform=platform, dtype=config.train.compute_dtype,
                    seq_len=method.shortest_window(config), head_dim=config.model.dim_per_head,
                    sinks=family_of(config.model).attention_sinks(config.model),
                ),
                config.attention.block_size,
                config.attention.max_documents,
            ),
            head_stages=config.model.num_attention_heads // config.heads_per_stage,
            remat=config.memory.remat,
            layers_per_checkpoint=config.memory.layers_per_checkpoint,
            remat_segments=config.remat_segments if len(config.remat_segments) > 1 else (),
            mlp_tile=config.memory.mlp_tile,
            loss_tile=config.memory.loss_tile,
            grouped_matmul=_chosen_kernel("grouped_matmul", config.kernels.grouped_matmul, grouped_matmul, platform),
            gated_delta=_chosen_kernel("gated_delta", config.kernels.gated_delta, gated_delta, platform,
                                       interpreted=platform == "cpu" and config.train.compute_dtype == "bfloat16"),
            interpret_kernels=platform == "cpu",
            router_aux_loss=config.train.router_aux_loss,
        )


def _chosen_kernel(setting: str, name: str, registry, platform: str, interpreted: bool = False) -> str:
    """`kernels.<setting>` resolved on `platform`: `auto` the registry's pick, else a name it holds (not one
    a model runs on GPUs only where its kernels would be `interpreted`)."""
    if name == "auto":
        return registry.kernel_for(platform)
    if name not in registry.KERNELS:
        raise JlongError(f"kernels.{setting} must be auto or one of {', '.join(registry.KERNELS)}, got {name!r}")
    if interpreted and name in registry.GPU_ONLY_IN_MODELS:
        others = ", ".join(k for k in registry.KERNELS if k not in registry.GPU_ONLY_IN_MODELS)
        raise JlongError(f"kernels.{setting}={name} runs in a bf16 model on GPUs only (jax's interpreter of it calls "
                         f"back to the host, which the model's checkpoints refuse): on the CPU pick one of {others}, "
                         "or plan for a GPU (--target h100)")
    return name


def layer_runs(config: ModelConfig, options: ForwardOptions) -> list[tuple[int, int, ForwardOptions]]:
    """The layers as runs [first, last) that run alike, each with its forward
    options: the runs under one remat policy (`options.remat_segments`) cut
    where the family's layer type changes (its window and RoPE)."""
    family, L = family_of(config), config.num_hidden_layers
    kinds = family.layer_types(config)
    segments = options.remat_segments or (RematSegment(options.remat, L, options.layers_per_checkpoint),)
    runs, first = [], 0
    for segment in segments:
        segment_end = first + segment.layers
        cuts = [first, *(i for i in range(first + 1, segment_end) if kinds[i] != kinds[i - 1]), segment_end]
        for start, end in zip(cuts, cuts[1:]):
            attention = dataclasses.replace(options.attention, window=family.attention_window(config, kinds[start]))
            runs.append((start, end, dataclasses.replace(
                options, remat=segment.remat, remat_segments=(), layers_per_checkpoint=segment.layers_per_checkpoint,
                layer_type=kinds[start], attention=attention)))
        first = segment_end
    return runs


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers [first, first + repeats x len(period)) scanned as one loop of
    `repeats` iterations over a body of len(period) layers, each run with
    its options in `period`."""

    first: int
    repeats: int
    period: tuple[ForwardOptions, ...]


def layer_groups(config: ModelConfig, options: ForwardOptions) -> list[LayerGroup]:
    """The layers as loops: each run of `layer_runs` on its own (a body of one
    layer), except where a remat segment's layers repeat with a period of
    several layers (Qwen3.5: 3 Gated DeltaNet + 1 attention; Gemma 3: 5
    sliding + 1 global): one loop over the periods, so a 64-layer hybrid
    compiles one 4-layer body rather than 32 loops. A segment that keeps
    one input per k > 1 layers is scanned by period where k divides the
    period, else by its runs."""
    L = config.num_hidden_layers
    runs = layer_runs(config, options)
    per_layer = [run_options for first, last, run_options in runs for _ in range(first, last)]
    segments = options.remat_segments or (RematSegment(options.remat, L, options.layers_per_checkpoint),)
    groups, first = [], 0
    for segment in segments:
        end = first + segment.layers
        period = shortest_period(per_layer[first:end])
        if 1 < period < end - first and period % segment.layers_per_checkpoint == 0:
            groups.append(LayerGroup(first, (end - first) // period, tuple(per_layer[first:first + period])))
        else:
            groups += [LayerGroup(start, last - start, (o,)) for start, last, o in runs if first <= start < end]
        first = end
    return groups


def _param(spec: ParamSpec, key, dtype) -> nnx.Param:
    return nnx.Param(spec.initial(key, spec.shape, dtype), axes=spec.axes)


def layer_specs(config: ModelConfig, lora: LoraSettings | None = None) -> dict[str, ParamSpec]:
    """The layer parameters of a model: its family's, and a LoRA run's adapters."""
    specs = family_of(config).layer_params(config)
    return {**specs, **adapter_specs(config, lora)} if lora else specs


class LayerStack(nnx.Module):
    """All decoder layers' parameters, each stacked to [layers, ...] over the
    layers that have it: every layer, or those of its `layer_type`. A LoRA
    run's adapters are layer parameters too, in `adapter_dtype`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype, lora: LoraSettings | None = None,
                 adapter_dtype: str = "float32"):
        family = family_of(config)
        specs = layer_specs(config, lora)
        self.names = tuple(specs)
        for name, spec in specs.items():
            dtype = adapter_dtype if lora and name in lora.adapter_names else param_dtype
            value = spec.initial(rngs.params(), (family.layers_with(config, spec), *spec.shape), dtype)
            setattr(self, name, nnx.Param(value, axes=("layers", *spec.axes)))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name).get_value() for name in self.names}


class Transformer(nnx.Module):
    """Token ids [B, S] -> float32 logits [B, S, vocab]. With `lora`, the
    layers' target matrices carry adapters (`jlong.lora`), in `adapter_dtype`;
    a QLoRA base's matrices may arrive in NF4 (`jlong.lora.nf4`)."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: str = "float32",
        options: ForwardOptions = ForwardOptions(),
        lora: LoraSettings | None = None,
        adapter_dtype: str = "float32",
    ):
        self.config = config
        self.options = options
        self.lora = lora
        outer = family_of(config).outer_params(config)
        self.embed = _param(outer["embed"], rngs.params(), param_dtype)
        self.layers = LayerStack(config, rngs=rngs, param_dtype=param_dtype, lora=lora, adapter_dtype=adapter_dtype)
        self.final_norm = _param(outer["final_norm"], None, param_dtype)  # ones: draws no key
        if "lm_head" in outer:
            self.lm_head = _param(outer["lm_head"], rngs.params(), param_dtype)

    def __call__(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
        """Logits of tokens in the model's layout (see `hidden_states`), in that layout."""
        return self.logits(self.hidden_states(tokens_BS, segment_ids_BS, positions_BS))

    def hidden_states(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
        """The final-normed hidden states [B, S, D] in the compute dtype, of
        tokens in the model's layout: in sequence order, or with a ring,
        zigzag over it (`jlong.ops.zigzag`: whoever places the batch
        lays it out). Without `positions`, each token's position is its index
        in the sequence."""
        return self.hidden_states_and_routing(tokens_BS, segment_ids_BS, positions_BS)[0]

    def hidden_states_and_routing(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
        """(`hidden_states`, the routing statistics of its mixture-of-experts
        layers: each entry of `jlong.moe.routing`'s dict stacked over them, or
        None for a model without)."""
        hidden_BSD, routing, _ = self.run_layers(tokens_BS, segment_ids_BS, positions_BS)
        return hidden_BSD, routing

    def run_layers(self, tokens_BS, segment_ids_BS=None, positions_BS=None, *, options: ForwardOptions | None = None,
                   layer_io: LayerIO | None = None):
        """(the final-normed hidden states, the routing statistics, what the
        layers wrote through `layer_io`), run with `options` (default: the
        model's own).

        `layer_io` (a sampler's caches, `jlong.model.layer_io`) hands each
        layer its slice of arrays stacked over the layers of a type, through
        the sequence-parallel method the layer runs with; what the method
        wrote comes back per layer type, stacked over those layers in order."""
        config, options = self.config, options or self.options
        constrain = options.shards.constrain
        dtype = jnp.dtype(options.compute_dtype)
        embed_VD = constrain(self.embed.get_value().astype(dtype), ("vocab", "embed"))
        family = family_of(config)
        x_BSD = constrain(family.scale_embeddings(jnp.take(embed_VD, tokens_BS, axis=0), config), HIDDEN)

        specs = layer_specs(config, self.lora)
        layer_axes = {name: spec.axes for name, spec in specs.items()}
        io_inputs = layer_io.inputs if layer_io else {}
        layer_type_of = {**{name: spec.layer_type for name, spec in specs.items()},
                         **{name: kind for name, (kind, _) in io_inputs.items()}}

        def in_compute_layout(w, axes):
            """Cast, then constrain to the compute layout: under FSDP this is where
            each layer's weights are gathered, in the compute dtype (a 4-bit
            weight gathered in 4 bits, then dequantized)."""
            if is_quantized(w):
                return dequantize(jax.tree.map(lambda leaf: constrain(leaf, axes), w), dtype)
            return constrain(w.astype(dtype), axes)

        def layer_under(layer_options: ForwardOptions):
            def one_layer(x_BSD, params):
                inputs = {name: w for name, w in params.items() if name in io_inputs}
                params = {name: in_compute_layout(w, layer_axes[name]) for name, w in params.items()
                          if name not in io_inputs}
                if self.lora:
                    params = adapted_layer(params, self.lora)
                run_options, written = layer_options, None
                if layer_io:
                    method = layer_io.method_for(layer_options, inputs)
                    run_options = dataclasses.replace(layer_options, sequence_parallel=method)
                out = family.block(params, x_BSD, positions_BS, segment_ids_BS, config, run_options)
                x_BSD, statistics = out if isinstance(out, tuple) else (out, None)  # statistics from a MoE layer
                if layer_io:
                    written = method.written
                return x_BSD, (statistics, written)

            return one_layer

        stacked = {**self.layers.arrays(), **{name: array for name, (_, array) in io_inputs.items()}}

        def of_group(group: LayerGroup):  # each array's layers in the group: [repeats, per period, ...]
            types = {o.layer_type for o in group.period}
            layers = {}
            for name, w in stacked.items():
                kind = layer_type_of[name]
                if kind not in (None, *types):
                    continue
                count = sum(kind in (None, o.layer_type) for o in group.period) * group.repeats
                first = family.stack_index(config, kind, group.first)
                layers[name] = jax.tree.map(  # leaf by leaf: a 4-bit weight is codes and scales
                    lambda a: (a if count == a.shape[0] else a[first:first + count]).reshape(
                        group.repeats, count // group.repeats, *a.shape[1:]), w)
            return layers

        routing = []  # each MoE layer's statistics, stacked over the layers of a loop
        written = {}  # layer type -> what its layers wrote through layer_io, in layer order
        for group in layer_groups(config, options):
            layers = of_group(group)
            if len(group.period) == 1:  # a run of one type
                [run_options] = group.period
                x_BSD, (statistics, wrote) = scan_layers(
                    layer_under(run_options), x_BSD, jax.tree.map(lambda w: w[:, 0], layers),
                    remat_policy(run_options.remat), run_options.layers_per_checkpoint)
                routing.append(statistics)
                written.setdefault(run_options.layer_type, []).append(wrote)
            else:
                x_BSD, outs = scan_periods(
                    [layer_under(o) for o in group.period], x_BSD, layers,
                    [remat_policy(o.remat) for o in group.period], self._slots(group, layer_type_of),
                    group.period[0].layers_per_checkpoint)
                routing += [statistics for statistics, _ in outs]
                for kind in {o.layer_type for o in group.period}:
                    wrote = [w for o, (_, w) in zip(group.period, outs) if o.layer_type == kind]
                    written.setdefault(kind, []).append(jax.tree.map(  # [repeats, per period] -> layer order
                        lambda *each: jnp.stack(each, 1).reshape(-1, *each[0].shape[1:]), *wrote))
        routing = [statistics for statistics in routing if statistics is not None]
        routing = jax.tree.map(lambda *each: jnp.concatenate(each), *routing) if routing else None
        written = {kind: jax.tree.map(lambda *each: jnp.concatenate(each), *runs)
                   for kind, runs in written.items() if layer_io}
        return family.final_norm(x_BSD, self.final_norm.get_value(), config, options), routing, written

    @staticmethod
    def _slots(group: LayerGroup, layer_type_of: dict[str, str | None]) -> list[dict[str, int]]:
        """For each layer of the period, the index of its entry in each
        stacked array's per-period stack (the arrays it has)."""
        slots = []
        for i, layer_options in enumerate(group.period):
            kind = layer_options.layer_type
            earlier = [o.layer_type for o in group.period[:i]]
            slots.append({name: i if of_type is None else earlier.count(kind)
                          for name, of_type in layer_type_of.items() if of_type in (None, kind)})
        return slots

    def output_embedding(self):
        """The [D, vocab] matrix that maps hidden states to logits."""
        if self.config.tie_word_embeddings:
            return self.embed.get_value().T
        return self.lm_head.get_value()

    def output_weights(self, dtype):
        """The output embedding in the compute dtype and layout."""
        return self.options.shards.constrain(self.output_embedding().astype(dtype), ("embed", "vocab"))

    def logits(self, hidden_BSD):
        return output_logits(hidden_BSD, self.output_weights(hidden_BSD.dtype))

    def loss(self, batch: dict):
        """The training loss of a batch (`loss_and_metrics`)."""
        return self.loss_and_metrics(batch)[0]

    def loss_and_metrics(self, batch: dict):
        """(training loss, metrics) of a batch (`inputs`, `targets`, and
        optionally `loss_mask`, `segment_ids`, `positions`, each [B, S]).

        The loss is the mean next-token cross-entropy (with `loss_tile`,
        computed without the whole logits; a mean over tokens, the same in
        any layout of the sequence), plus, for a mixture of experts with
        the `router_aux_loss` option, `router_aux_loss_coef` x the
        load-balancing loss. Metrics: for a mixture of experts,
        `expert_load_max_over_mean` (and `router_aux_loss` when it is trained)."""
        hidden_BSD, routing = self.hidden_states_and_routing(
            batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
        targets_BS, mask_BS = batch["targets"], batch.get("loss_mask")
        if tile := self.options.loss_tile:
            loss = tiled_cross_entropy(
                hidden_BSD, self.output_weights(hidden_BSD.dtype), targets_BS, mask_BS, tile=tile,
                shards=self.options.shards,
            )
        else:
            loss = cross_entropy(self.logits(hidden_BSD), targets_BS, mask_BS)
        return self.with_routing(loss, {}, routing)

    def with_routing(self, loss, metrics: dict, routing):
        """The loss and metrics of a mixture of experts: its load statistic, and
        router_aux_loss_coef x its load-balancing loss when that is trained."""
        if routing is None:
            return loss, metrics
        metrics = {**metrics, "expert_load_max_over_mean": expert_load_max_over_mean(routing)}
        if self.options.router_aux_loss:
            metrics["router_aux_loss"] = load_balancing_loss(routing)
            loss = loss + self.config.router_aux_loss_coef * metrics["router_aux_loss"]
        return loss, metrics

    def document_logps_and_routing(self, batch: dict, count: int):
        """([B, count] sums of log p(target) per document slot of each row
        (`batch["pair_documents"]`, `jlong.model.document_sums`), the routing statistics)."""
        hidden_BSD, routing = self.hidden_states_and_routing(
            batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
        logps = document_logps(hidden_BSD, self.output_weights(hidden_BSD.dtype), batch["targets"],
                               batch["pair_documents"], count=count, tile=self.options.loss_tile,
                               shards=self.options.shards)
        return logps, routing

    def token_logprobs_and_routing(self, batch: dict, temperature: float = 1.0):
        """(log p(target) [B, S] and the entropy of p [B, S] per token, p the softmax of logits / temperature,
        float32 in the batch's layout, tiled as the loss is (`memory.loss_tile`: never [S, V]); the routing
        statistics)."""
        hidden_BSD, routing = self.hidden_states_and_routing(
            batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
        if temperature != 1.0:  # logits / T = (h / T) @ W
            hidden_BSD = (hidden_BSD.astype(jnp.float32) / temperature).astype(hidden_BSD.dtype)
        logprobs = target_logprobs(hidden_BSD, self.output_weights(hidden_BSD.dtype), batch["targets"],
                                   tile=self.options.loss_tile, shards=self.options.shards)
        return logprobs, routing

    def token_scores(self, batch: dict):
        """[B, S, 2] float32 per target token, in the batch's layout: its
        cross-entropy, and 1.0 where it is the model's most likely next token."""
        hidden_BSD = self.hidden_states(batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
        return token_scores(hidden_BSD, self.output_weights(hidden_BSD.dtype), batch["targets"],
                            tile=self.options.loss_tile, shards=self.options.shards)
