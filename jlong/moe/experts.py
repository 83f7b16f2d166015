"""Routed SwiGLU experts as a residual channel mixer: x + experts(norm(x)),
on each device's tokens, a sequence tile at a time.

Per tile of T tokens: route (`routing.route`), sort the T x k (token, expert)
pairs by expert, gather each pair's normed token, run the experts' gate, up
and down projections as grouped matmuls over the sorted rows (the FLOPs of
the routed pairs, nothing for an expert a token did not choose), put the
pairs back in token order and sum each token's k outputs weighted by its
router probabilities. A shared expert (Qwen3.5-MoE) is a SwiGLU every token
runs, scaled by sigmoid(h . w_shared_gate), added to the routed experts'.

GPT-OSS's experts differ in options of `MixtureOfExperts`, each off by
default: the router's bias and its weights from a softmax over the chosen
logits (`routing.route`); one gate-and-up matrix [E, D, 2F] whose columns
alternate gate, up (Hugging Face's `gate_up_proj`), so one grouped matmul
makes both; a bias per expert on each projection, gathered for each sorted
row by the row's expert and added to the grouped matmul's output; and the
clamped SwiGLU (`ClampedSwiGLU`).

DeepSeek's (V2, V3, GLM-4.7-Flash) route by `group_routing.GroupLimitedRouting`
(with V3's correction bias `router_correction_bias` [E] for choosing) and
add shared experts every token runs, one ungated SwiGLU (`shared_mlp`:
`shared_gate`, `shared_up`, `shared_down`).

No capacity limit: every pair is computed, so the output is exactly the
dense definition's. Memory is bounded by a tile (`memory.mlp_tile`, or the
device's whole shard when unset): its pairs' rows and intermediates, as the
tiled MLP's; the backward pass recomputes one tile at a time
(`jlong.ops.tiling.map_tiles`).

The layer's routing statistics (`routing`) are summed over every device's
tiles by a second pass over the tokens that computes only the router (1/F of
an expert's work per choice): it keeps the experts' tile loop free of any
output but the residual stream.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jlong.moe.group_routing import GroupLimitedRouting
from jlong.moe.grouped_matmul import matmul
from jlong.moe.routing import group_by_expert, no_statistics, route, tile_statistics
from jlong.ops.layers import rms_norm, swiglu
from jlong.ops.shards import HIDDEN, REPLICATED
from jlong.ops.tiling import map_tiles, tile_at, varying_like

ROUTED_PARAMS = ("mlp_norm", "router", "expert_gate", "expert_up", "expert_down")
FUSED_PARAMS = ("mlp_norm", "router", "expert_gate_up", "expert_down")  # gate and up in one matrix (GPT-OSS)
SHARED_PARAMS = ("w_gate", "w_up", "w_down", "shared_expert_gate")
SHARED_MLP_PARAMS = ("shared_gate", "shared_up", "shared_down")  # DeepSeek's shared experts, ungated
ROUTER_BIAS = "router_bias"
CORRECTION_BIAS = "router_correction_bias"  # DeepSeek-V3's: added to the scores for choosing only
EXPERT_BIASES = {"expert_gate_up": "expert_gate_up_bias", "expert_gate": "expert_gate_bias",
                 "expert_up": "expert_up_bias", "expert_down": "expert_down_bias"}


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: the gate clamped above at `limit`, up to
    [-limit, limit], then (up + 1) x gate x sigmoid(alpha x gate); in float32."""

    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate, up):
        dtype = gate.dtype
        gate = jnp.minimum(gate.astype(jnp.float32), self.limit)
        up = jnp.clip(up.astype(jnp.float32), -self.limit, self.limit)
        return ((up + 1.0) * gate * jax.nn.sigmoid(self.alpha * gate)).astype(dtype)


def silu_gate(gate, up):
    """SwiGLU's activation: silu(gate) x up."""
    return jax.nn.silu(gate) * up


@dataclasses.dataclass(frozen=True)
class MixtureOfExperts:
    num_experts: int
    top_k: int
    normalize: bool  # renormalise each token's top-k probabilities to sum to one
    shared_expert: bool = False  # plus a SwiGLU every token runs, gated per token (Qwen3.5-MoE)
    kernel: str = "ragged_dot"  # `grouped_matmul.KERNELS`
    interpret: bool = False  # a GPU kernel in its interpreter (on the CPU)
    router_bias: bool = False  # the router's logits have a bias per expert, `router_bias` [E] (GPT-OSS)
    softmax_after_top_k: bool = False  # weights: a softmax over the k chosen logits (GPT-OSS)
    fused_gate_up: bool = False  # `expert_gate_up` [E, D, 2F], columns alternating gate, up (GPT-OSS)
    expert_bias: bool = False  # each projection has a bias per expert: `expert_gate_up_bias` [E, 2F], ... (GPT-OSS)
    activation: Callable = silu_gate  # (gate, up) -> hidden; GPT-OSS's `ClampedSwiGLU`
    grouped: GroupLimitedRouting | None = None  # DeepSeek's routing in place of `routing.route`
    correction_bias: bool = False  # `router_correction_bias` [E] for choosing (DeepSeek-V3; with `grouped`)
    shared_mlp: bool = False  # plus an ungated SwiGLU every token runs (DeepSeek's shared experts)

    @property
    def param_names(self) -> tuple[str, ...]:
        names = FUSED_PARAMS if self.fused_gate_up else ROUTED_PARAMS
        if self.expert_bias:
            names += tuple(EXPERT_BIASES[name] for name in names if name in EXPERT_BIASES)
        names += self.router_param_names[2:]
        return names + (SHARED_PARAMS if self.shared_expert else ()) + (SHARED_MLP_PARAMS if self.shared_mlp else ())

    @property
    def router_param_names(self) -> tuple[str, ...]:
        """What the routing statistics read."""
        biases = (ROUTER_BIAS,) * self.router_bias + (CORRECTION_BIAS,) * self.correction_bias
        return ("mlp_norm", "router", *biases)

    def route(self, p, h_TD):
        """(probabilities [T, E], weights [T, k], experts [T, k]) of tokens h [T, D] by this mixture's
        router: `routing.route`, or DeepSeek's `grouped` routing."""
        if self.grouped is not None:
            return self.grouped.route(h_TD, p["router"], top_k=self.top_k, normalize=self.normalize,
                                      correction_bias_E=p[CORRECTION_BIAS] if self.correction_bias else None)
        return route(h_TD, p["router"], top_k=self.top_k, normalize=self.normalize,
                     bias_E=p[ROUTER_BIAS] if self.router_bias else None, softmax_after_top_k=self.softmax_after_top_k)

    def __call__(self, p, h_TD):
        """The experts' output [T, D] for normed tokens h [T, D]: `router` [D, E],
        `expert_gate`, `expert_up` [E, D, F] (or `expert_gate_up` [E, D, 2F]),
        `expert_down` [E, F, D], the biases its options name (and the
        shared expert's `w_gate`, `w_up`, `w_down`, `shared_expert_gate` [D],
        or the ungated one's `shared_gate`, `shared_up`, `shared_down`)."""
        T, D = h_TD.shape
        k = self.top_k
        _, weights_Tk, experts_Tk = self.route(p, h_TD)
        order_P, group_sizes_E = group_by_expert(experts_Tk, self.num_experts)
        rows_PD = jnp.take(h_TD, order_P // k, axis=0)
        matmul_ = functools.partial(matmul(self.kernel, interpret=self.interpret), group_sizes_G=group_sizes_E)
        expert_P = jnp.take(experts_Tk.reshape(-1), order_P) if self.expert_bias else None  # each sorted row's

        def grouped(x_PK, name):
            y_PN = matmul_(x_PK, p[name])
            if self.expert_bias:
                y_PN = y_PN + jnp.take(p[EXPERT_BIASES[name]], expert_P, axis=0).astype(y_PN.dtype)
            return y_PN

        if self.fused_gate_up:
            gate_up_PF2 = grouped(rows_PD, "expert_gate_up")
            gate_PF, up_PF = gate_up_PF2[:, 0::2], gate_up_PF2[:, 1::2]
        else:
            gate_PF, up_PF = grouped(rows_PD, "expert_gate"), grouped(rows_PD, "expert_up")
        out_PD = grouped(self.activation(gate_PF, up_PF), "expert_down")
        in_token_order = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(T * k, dtype=order_P.dtype))
        out_TkD = jnp.take(out_PD, in_token_order, axis=0).reshape(T, k, D)
        out_TD = jnp.einsum("tkd,tk->td", out_TkD, weights_Tk.astype(out_TkD.dtype))
        if self.shared_expert:
            gate_T1 = jax.nn.sigmoid(jnp.einsum("td,d->t", h_TD, p["shared_expert_gate"]))[:, None]
            out_TD = out_TD + gate_T1 * swiglu(h_TD[None], p["w_gate"], p["w_up"], p["w_down"])[0]
        if self.shared_mlp:
            out_TD = out_TD + swiglu(h_TD[None], *(p[name] for name in SHARED_MLP_PARAMS))[0]
        return out_TD

    def residual(self, p, x_BSD, *, eps: float, shards, tile: int):
        """x + experts(rms_norm(x, mlp_norm)) per device, `tile` tokens of its
        shard at a time (0: the whole shard as one tile)."""
        fn = functools.partial(self._residual_tile, eps=eps)

        def per_device(params, x_BsD):
            return map_tiles(fn, params, x_BsD, tile or x_BsD.shape[1])

        return shards.map(per_device, (REPLICATED, HIDDEN), HIDDEN)({n: p[n] for n in self.param_names}, x_BSD)

    def _residual_tile(self, p, x_BTD, *, eps):
        B, T, D = x_BTD.shape
        h_TD = rms_norm(x_BTD, p["mlp_norm"], eps).reshape(B * T, D)
        return x_BTD + self(p, h_TD).reshape(B, T, D)

    def statistics(self, p, x_BSD, *, eps: float, shards, tile: int, differentiable: bool) -> dict:
        """The layer's `routing` statistics over every device's tokens (each
        device's tiles, summed over the mesh); `differentiable`: the router
        probabilities' sums carry gradients (for the load-balancing loss)."""
        params = {name: p[name] for name in self.router_param_names}
        if not differentiable:
            params, x_BSD = jax.lax.stop_gradient((params, x_BSD))

        def per_device(params, x_BsD):
            params = varying_like(params, x_BsD)
            size = tile or x_BsD.shape[1]

            def one_tile(i, total):
                x_BTD = tile_at(x_BsD, i, size)
                h_TD = rms_norm(x_BTD, params["mlp_norm"], eps).reshape(-1, x_BTD.shape[-1])
                probabilities_TE, _, experts_Tk = self.route(params, h_TD)
                return jax.tree.map(jnp.add, total, tile_statistics(probabilities_TE, experts_Tk))

            total = jax.lax.fori_loop(0, x_BsD.shape[1] // size, jax.checkpoint(one_tile),
                                      varying_like(no_statistics(self.num_experts), x_BsD))
            return jax.lax.psum(total, shards.all_axes) if shards.all_axes else total

        return shards.map(per_device, (REPLICATED, HIDDEN), REPLICATED)(params, x_BSD)
