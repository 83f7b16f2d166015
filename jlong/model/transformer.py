"""The decoder-only transformer (Llama 3.x, Qwen 2.5, Qwen 3) in Flax NNX.

Layer parameters are stacked along a leading `layers` axis and the layers run
as one `lax.scan`, so XLA compiles a single layer whatever the depth. Every
parameter carries the logical axis names of its dimensions (`axes` metadata);
`jlong.sharding` maps those names to mesh axes.

Weights keep the head axis explicit (q projection [D, H, d], output
projection [H, d, D]) so attention can take any subset of heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlong.attention.ulysses import HeadProjections, staged_attention
from jlong.config import ModelConfig
from jlong.model.layers import apply_rope, rms_norm, rope_inverse_frequencies, swiglu
from jlong.model.remat import checkpoint_layer, name_layer_input
from jlong.model.tiling import map_tiles
from jlong.sharding import constrain, sequence_shards

INIT_STD = 0.02  # the initializer_range of the Hugging Face configs


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """How the forward pass computes; none of it changes the parameters."""

    compute_dtype: str = "float32"
    attention_impl: str = "auto"
    block_size: int = 512
    heads_per_stage: int = 0  # UPipe's U; 0 = all heads in one stage
    remat: str = "none"  # a `jlong.model.remat` policy for each layer
    mlp_tile: int = 0  # tokens per sequence tile of the MLP on each device; 0 = untiled


def layer_param_shapes(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Shape and logical axes of each per-layer parameter (without the layers axis)."""
    D, F = config.hidden_size, config.intermediate_size
    H, K, d = config.num_attention_heads, config.kv_heads, config.dim_per_head
    shapes = {
        "attn_norm": ((D,), ("embed",)),
        "wq": ((D, H, d), ("embed", "heads", "head_dim")),
        "wk": ((D, K, d), ("embed", "kv_heads", "head_dim")),
        "wv": ((D, K, d), ("embed", "kv_heads", "head_dim")),
        "wo": ((H, d, D), ("heads", "head_dim", "embed")),
        "mlp_norm": ((D,), ("embed",)),
        "w_gate": ((D, F), ("embed", "mlp")),
        "w_up": ((D, F), ("embed", "mlp")),
        "w_down": ((F, D), ("mlp", "embed")),
    }
    if config.attention_bias:
        shapes["bq"] = ((H, d), ("heads", "head_dim"))
        shapes["bk"] = ((K, d), ("kv_heads", "head_dim"))
        shapes["bv"] = ((K, d), ("kv_heads", "head_dim"))
    if config.qk_norm:
        shapes["q_norm"] = ((d,), ("head_dim",))
        shapes["k_norm"] = ((d,), ("head_dim",))
    return shapes


def _initial_value(name: str, key, shape, dtype):
    if name.endswith("norm"):
        return jnp.ones(shape, dtype)
    if name.startswith("b"):
        return jnp.zeros(shape, dtype)
    return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


class LayerStack(nnx.Module):
    """All decoder layers' parameters, each stacked to [num_layers, ...]."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, param_dtype):
        L = config.num_hidden_layers
        shapes = layer_param_shapes(config)
        self.names = tuple(shapes)
        for name, (shape, axes) in shapes.items():
            value = _initial_value(name, rngs.params(), (L, *shape), param_dtype)
            setattr(self, name, nnx.Param(value, axes=("layers", *axes)))

    def arrays(self) -> dict[str, jax.Array]:
        return {name: getattr(self, name).get_value() for name in self.names}


class Transformer(nnx.Module):
    """Token ids [B, S] -> float32 logits [B, S, vocab]."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs,
        param_dtype: str = "float32",
        options: ForwardOptions = ForwardOptions(),
    ):
        self.config = config
        self.options = options
        V, D = config.vocab_size, config.hidden_size
        self.embed = nnx.Param(
            _initial_value("embed", rngs.params(), (V, D), param_dtype), axes=("vocab", "embed")
        )
        self.layers = LayerStack(config, rngs=rngs, param_dtype=param_dtype)
        self.final_norm = nnx.Param(jnp.ones((D,), param_dtype), axes=("embed",))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(
                _initial_value("lm_head", rngs.params(), (D, V), param_dtype),
                axes=("embed", "vocab"),
            )

    def __call__(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
        return self.logits(self.hidden_states(tokens_BS, segment_ids_BS, positions_BS))

    def hidden_states(self, tokens_BS, segment_ids_BS=None, positions_BS=None):
        """The final-normed hidden states [B, S, D] in the compute dtype."""
        config, options = self.config, self.options
        dtype = jnp.dtype(options.compute_dtype)
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        embed_VD = constrain(self.embed.get_value().astype(dtype), ("vocab", "embed"))
        x_BSD = constrain(jnp.take(embed_VD, tokens_BS, axis=0), ("batch", "seq", "embed"))

        layer_axes = {name: axes for name, (_, axes) in layer_param_shapes(config).items()}

        def one_layer(x_BSD, params):
            # Cast, then constrain to the compute layout: under FSDP this is
            # where each layer's weights are gathered (in the compute dtype).
            params = {name: constrain(w.astype(dtype), layer_axes[name]) for name, w in params.items()}
            x_BSD = decoder_layer(params, x_BSD, positions_BS, segment_ids_BS, config, options)
            return x_BSD, None

        layer = checkpoint_layer(one_layer, options.remat)
        x_BSD, _ = jax.lax.scan(layer, x_BSD, self.layers.arrays())
        return sequence_norm(x_BSD, self.final_norm.get_value(), config, options)

    def output_embedding(self):
        """The [D, vocab] matrix that maps hidden states to logits."""
        if self.config.tie_word_embeddings:
            return self.embed.get_value().T
        return self.lm_head.get_value()

    def output_weights(self, dtype):
        """The output embedding in the compute dtype and layout."""
        return constrain(self.output_embedding().astype(dtype), ("embed", "vocab"))

    def logits(self, hidden_BSD):
        return output_logits(hidden_BSD, self.output_weights(hidden_BSD.dtype))


def output_logits(hidden_BSD, w_DV):
    return jnp.einsum("bsd,dv->bsv", hidden_BSD, w_DV, preferred_element_type=jnp.float32)


def decoder_layer(p, x_BSD, positions_BS, segment_ids_BS, config, options):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x))."""
    x_BSD = name_layer_input(x_BSD)
    h_BSD = sequence_norm(x_BSD, p["attn_norm"], config, options)
    x_BSD = x_BSD + attention_block(p, h_BSD, positions_BS, segment_ids_BS, config, options)
    x_BSD = constrain(x_BSD, ("batch", "seq", "embed"))
    return constrain(mlp_block(p, x_BSD, config, options), ("batch", "seq", "embed"))


MLP_PARAMS = ("mlp_norm", "w_gate", "w_up", "w_down")


def sequence_norm(x_BSD, weight, config, options):
    """RMSNorm of the residual stream; with `mlp_tile`, tile by tile like the
    MLP, so its float32 intermediates never span the whole shard."""
    norm = functools.partial(_tile_norm, eps=config.rms_norm_eps)
    return _per_sequence_tile(norm, weight, x_BSD, options.mlp_tile)


def _tile_norm(weight, x_BSD, *, eps):
    return rms_norm(x_BSD, weight, eps)


def mlp_block(p, x_BSD, config, options):
    """x + swiglu(norm(x)); with `mlp_tile`, computed per device over
    sequence tiles so no [tokens, intermediate] buffer spans the whole shard."""
    p = {name: p[name] for name in MLP_PARAMS}
    residual_mlp = functools.partial(_residual_mlp, eps=config.rms_norm_eps)
    return _per_sequence_tile(residual_mlp, p, x_BSD, options.mlp_tile)


def _per_sequence_tile(fn, params, x_BSD, tile: int):
    """fn(params, x) as it is (tile 0), or on each device's shard tile by tile."""
    if not tile:
        return fn(params, x_BSD)
    per_device = functools.partial(map_tiles, fn, tile=tile)
    return sequence_shards().map(per_device, ("replicated", "hidden"), "hidden")(params, x_BSD)


def _residual_mlp(p, x_BSD, *, eps):
    h_BSD = rms_norm(x_BSD, p["mlp_norm"], eps)
    return x_BSD + swiglu(h_BSD, p["w_gate"], p["w_up"], p["w_down"])


def project_qkv(p, h_BSD, positions_BS, q_heads, kv_heads, *, config):
    """q for the query heads `q_heads` = (first, count) and k, v for the kv
    heads `kv_heads`, each [B, S, count, d], with bias, q/k norm and RoPE.

    One matmul computes all requested heads. Either range may be None; its
    outputs are then None.
    """
    weights, biases, names = [], [], []
    for name, heads in (("q", q_heads), ("k", kv_heads), ("v", kv_heads)):
        if heads is not None:
            names.append(name)
            weights.append(_heads(p[f"w{name}"], *heads, axis=1))
            if config.attention_bias:
                biases.append(_heads(p[f"b{name}"], *heads, axis=0))
    qkv = _project(h_BSD, jnp.concatenate(weights, axis=1))
    if config.attention_bias:
        qkv = qkv + jnp.concatenate(biases, axis=0)
    out = dict(zip(names, jnp.split(qkv, np.cumsum([w.shape[1] for w in weights])[:-1], axis=2)))
    inv_freq = rope_inverse_frequencies(config)
    for name in ("q", "k"):
        if name in out:
            if config.qk_norm:
                out[name] = rms_norm(out[name], p[f"{name}_norm"], config.rms_norm_eps)
            out[name] = apply_rope(out[name], positions_BS, inv_freq)
    return out.get("q"), out.get("k"), out.get("v")


def _project(x_BSD, w_DNd):
    """x @ w as one 2-D matmul: [B, S, D] x [D, N, d] -> [B, S, N, d]."""
    B, S, D = x_BSD.shape
    y = x_BSD.reshape(B * S, D) @ w_DNd.reshape(D, -1)
    return y.reshape(B, S, *w_DNd.shape[1:])


def _heads(w, first, count, axis):
    if count == w.shape[axis]:
        return w
    return jax.lax.dynamic_slice_in_dim(w, first, count, axis)


def project_out(p, o_BSHd, first, count):
    """o [B, S, count, d] of heads [first, first + count) through Wo: [B, S, D]."""
    wo = _heads(p["wo"], first, count, axis=0)
    return jnp.einsum("bshk,hkd->bsd", o_BSHd, wo)


ATTENTION_PARAMS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm")


def attention_block(p, h_BSD, positions_BS, segment_ids_BS, config, options):
    """Self-attention of the normed input, in Ulysses/UPipe head stages."""
    H = config.num_attention_heads
    return staged_attention(
        {name: p[name] for name in ATTENTION_PARAMS if name in p},
        h_BSD,
        positions_BS,
        segment_ids_BS,
        projections=HeadProjections(qkv=functools.partial(project_qkv, config=config), output=project_out),
        heads=(H, config.kv_heads, options.heads_per_stage or H),
        impl=options.attention_impl,
        block_size=options.block_size,
    )
