"""Decoding: one new token per sequence through every layer, against the
caches the prefill left and the tokens decoded since.

`DecodeLayers` is the model's `LayerIO` for a decode step: it hands each
layer its caches through a `OneQueryMethod`, the one-query twin of the
sequence-parallel methods, which the family's block calls as it calls them
in training:

- attention: the token's query against the prompt's keys and values (as
  the prefill laid them out, split over the sequence's devices), the
  tokens decoded before it (their slots split likewise) and its own key.
  Each device takes the softmax over the keys it holds; the partial
  results merge across the devices by their maxima and sums, as the ring's
  steps merge. A sliding-window layer attends its ring buffer, whole on
  each device. Sinks join the merged softmax once. The layer writes its
  new key and value, which the sampler puts in their slot after the step.
- a linear-attention layer: the recurrent step of the rule on each
  device's heads (`gated_deltanet_step`), the state and convolution inputs
  kept as the prefill split them; the layer writes them back.

The samples of one prompt share its prompt cache: rows are (prompt,
sample) pairs, B x N of them, sample-minor, and the query of row b x N + n
reads prompt b's keys. Scores and sums are float32; the products read the
caches in their own dtype.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jlong.attention.projection import add_output_bias, project_out
from jlong.attention.step import MASKED
from jlong.generation.prefill import sequence_axes
from jlong.linear_attention.gated_deltanet import gated_deltanet_step
from jlong.attention.methods.ulysses import KEPT_STATE
from jlong.ops.shards import HIDDEN, REPLICATED, TOKENS

KV_NEW = ("batch", "seq", "kv_heads", "head_dim")  # [R, 1, K, d]: a step's new key or value
PROMPT_KV = ("batch", "cached_tokens", "kv_heads", "head_dim")  # [B, P, K, d]
PROMPT_POSITIONS = ("batch", "cached_tokens")  # [B, P]
WINDOW_KV = ("batch", "window", "kv_heads", "head_dim")  # [R, W, K, d]
WINDOW_POSITIONS = ("batch", "window")  # [R, W]


@dataclasses.dataclass
class DecodeLayers:
    """A decode step's `LayerIO`: `inputs` holds, per layer type, its layers'
    caches stacked (names "TYPE/NAME"), and the slot positions every layer of
    a kind shares (-1: empty)."""

    inputs: dict[str, tuple[str, Any]]
    samples: int  # N, the rows per prompt
    prompt_positions: Any = None  # [B, P], laid out as the prompt cache
    new_positions: Any = None  # [R, M], the decoded tokens' slots
    window_positions: dict = dataclasses.field(default_factory=dict)  # window -> [R, W]

    def method_for(self, options, inputs) -> OneQueryMethod:
        prefix = f"{options.layer_type}/"
        own = {name.removeprefix(prefix): array for name, array in inputs.items() if name.startswith(prefix)}
        return OneQueryMethod(own, self)


class OneQueryMethod:
    """A layer's one-query method: what the layer wrote is in `written` after its block ran."""

    def __init__(self, caches: dict, layers: DecodeLayers):
        self.caches, self.layers = caches, layers
        self.written = None

    def attention(self, params, x_RqD, positions_Rq, segment_ids_Rq, *, projection, heads, kernel, shards,
                  unroll_stages=False, add_to_input=True):
        H, K, _ = heads
        layers, window = self.layers, kernel.window
        axes = sequence_axes(shards)

        def per_device(params, x, positions, caches, prompt_positions, cached_positions):
            q, k_new, v_new, gate, _ = projection.qkv(params, x, positions, (0, H), (0, K), x)
            o = _attend_one(q, k_new, v_new, positions[:, 0], caches, prompt_positions, cached_positions,
                            samples=layers.samples, window=window, axes=axes,
                            sink_logits=projection.sink_logits(params, 0, H))
            y = project_out(params, o.astype(x.dtype), 0, H, gate)
            y = add_output_bias(projection, params, x + y if add_to_input else y)
            return y, k_new, v_new

        if window:
            specs = ({"k": WINDOW_KV, "v": WINDOW_KV}, REPLICATED, WINDOW_POSITIONS)
            positions = (None, layers.window_positions[window])
        else:
            specs = ({"k": PROMPT_KV, "v": PROMPT_KV, "new_k": PROMPT_KV, "new_v": PROMPT_KV}, PROMPT_POSITIONS,
                     PROMPT_POSITIONS)
            positions = (layers.prompt_positions, layers.new_positions)
        run = shards.map(per_device, (REPLICATED, HIDDEN, TOKENS, *specs), (HIDDEN, KV_NEW, KV_NEW))
        y, k_new, v_new = run(params, x_RqD, positions_Rq, self.caches, *positions)
        self.written = {"k": k_new, "v": v_new}
        return y

    def linear_attention(self, params, x_RqD, segment_ids_Rq, *, layer, shards, tile=0, stages=1):
        sp = "sp" if "sp" in shards.mesh_axes else None  # of one device too: the sum makes y whole
        plan = layer.head_plan(shards.size("sp"), stages)

        def per_device(params, x, kept):
            device = 0 if sp is None else jax.lax.axis_index(sp)
            y, kept = gated_deltanet_step(params, x, kept, layer=layer, plan=plan, device=device)
            return x + (jax.lax.psum(y, sp) if sp else y), kept

        y, self.written = shards.map(per_device, (REPLICATED, HIDDEN, KEPT_STATE), (HIDDEN, KEPT_STATE))(
            params, x_RqD, self.caches)
        return y


def _attend_one(q_Rq, k_new, v_new, position_R, caches, prompt_positions, cached_positions, *, samples, window,
                axes, sink_logits):
    """o [R, 1, H, d] float32: each row's one query over its caches and its own key."""
    R, _, H, d = q_Rq.shape
    K, N = k_new.shape[2], samples
    q = (q_Rq.astype(jnp.float32) * d**-0.5).reshape(R // N, N, K, H // K, d)  # [b, N, K, G, d]
    position = position_R.reshape(R // N, N)

    def per_sample(t):  # [R, ...] -> [b, N, ...]
        return t.reshape(R // N, N, *t.shape[1:])

    def seen(slot_positions):  # [.., T] -> [b, N, 1, 1, T]: slots holding an earlier token within the window
        visible = (slot_positions >= 0) & (slot_positions < position[..., None])
        if window:
            visible &= position[..., None] - slot_positions < window
        return visible[:, :, None, None, :]

    if window:
        softmax = _part(q, per_sample(caches["k"]), per_sample(caches["v"]), seen(per_sample(cached_positions)))
    else:
        prompt_seen = seen(jnp.broadcast_to(prompt_positions[:, None], (R // N, N, prompt_positions.shape[1])))
        softmax = _merged(_part(q, caches["k"], caches["v"], prompt_seen),
                          _part(q, per_sample(caches["new_k"]), per_sample(caches["new_v"]),
                                seen(per_sample(cached_positions))))
        softmax = _across(softmax, axes)
    own = jnp.ones((R // N, N, 1, 1, 1), bool)
    m, l, acc = _merged(softmax, _part(q, per_sample(k_new), per_sample(v_new), own))
    o = acc / l[..., None]
    if sink_logits is not None:  # o' = o exp(lse - logaddexp(lse, s)), once per query
        lse, s = m + jnp.log(l), sink_logits.reshape(K, H // K)
        o = o * jnp.exp(lse - jnp.logaddexp(lse, s))[..., None]
    return o.reshape(R, 1, H, d)


def _part(q_bNKGd, k, v, seen_bN11T):
    """(max, sum of exponentials, their weighted values) of q's scores over keys k and values v, [b, N, T, K, d]
    or, shared by every sample of a prompt, [b, T, K, d]; the unseen ones left out. The products take the
    cache in its own dtype and sum in float32, as the training kernels do (the cache is never copied wider)."""
    keys = "bntkd" if k.ndim == 5 else "btkd"
    scores = jnp.einsum(f"bnkgd,{keys}->bnkgt", q_bNKGd.astype(k.dtype), k, preferred_element_type=jnp.float32)
    scores = jnp.where(seen_bN11T, scores, MASKED)
    m = jnp.max(scores, axis=-1)
    e = jnp.where(seen_bN11T, jnp.exp(scores - m[..., None]), 0.0)
    weighted = jnp.einsum(f"bnkgt,{keys}->bnkgd", e.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m, jnp.sum(e, axis=-1), weighted


def _merged(a, b):
    """Two parts of one softmax as one."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = jnp.maximum(m_a, m_b)
    scale_a, scale_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
    return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a[..., None] + acc_b * scale_b[..., None]


def _across(part, axes):
    """Each device's part of one softmax merged over the mesh `axes`."""
    if not axes:
        return part
    m, l, acc = part
    top = jax.lax.pmax(m, axes)
    scale = jnp.exp(m - top)
    return top, jax.lax.psum(l * scale, axes), jax.lax.psum(acc * scale[..., None], axes)
