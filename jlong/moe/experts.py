"""Routed SwiGLU experts as a residual channel mixer: x + experts(norm(x)),
on each device's tokens, a sequence tile at a time.

Per tile of T tokens: route (`routing.route`), sort the T x k (token, expert)
pairs by expert, gather each pair's normed token, run the experts' gate, up
and down projections as grouped matmuls over the sorted rows (the FLOPs of
the routed pairs, nothing for an expert a token did not choose), put the
pairs back in token order and sum each token's k outputs weighted by its
router probabilities. A shared expert (Qwen3.5-MoE) is a SwiGLU every token
runs, scaled by sigmoid(h . w_shared_gate), added to the routed experts'.

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

import jax
import jax.numpy as jnp

from jlong.moe.grouped_matmul import matmul
from jlong.moe.routing import group_by_expert, no_statistics, route, tile_statistics
from jlong.ops.layers import rms_norm, swiglu
from jlong.ops.shards import HIDDEN, REPLICATED
from jlong.ops.tiling import map_tiles, tile_at, varying_like

ROUTED_PARAMS = ("mlp_norm", "router", "expert_gate", "expert_up", "expert_down")
SHARED_PARAMS = ("w_gate", "w_up", "w_down", "shared_expert_gate")


@dataclasses.dataclass(frozen=True)
class MixtureOfExperts:
    num_experts: int
    top_k: int
    normalize: bool  # renormalise each token's top-k probabilities to sum to one
    shared_expert: bool = False  # plus a SwiGLU every token runs, gated per token (Qwen3.5-MoE)
    kernel: str = "ragged_dot"  # `grouped_matmul.KERNELS`
    interpret: bool = False  # a GPU kernel in its interpreter (on the CPU)

    @property
    def param_names(self) -> tuple[str, ...]:
        return ROUTED_PARAMS + (SHARED_PARAMS if self.shared_expert else ())

    def __call__(self, p, h_TD):
        """The experts' output [T, D] for normed tokens h [T, D]: `router` [D, E],
        `expert_gate`, `expert_up` [E, D, F], `expert_down` [E, F, D] (and the
        shared expert's `w_gate`, `w_up`, `w_down`, `shared_expert_gate` [D])."""
        T, D = h_TD.shape
        k = self.top_k
        _, weights_Tk, experts_Tk = route(h_TD, p["router"], top_k=k, normalize=self.normalize)
        order_P, group_sizes_E = group_by_expert(experts_Tk, self.num_experts)
        rows_PD = jnp.take(h_TD, order_P // k, axis=0)
        grouped = functools.partial(matmul(self.kernel, interpret=self.interpret), group_sizes_G=group_sizes_E)
        hidden_PF = jax.nn.silu(grouped(rows_PD, p["expert_gate"])) * grouped(rows_PD, p["expert_up"])
        out_PD = grouped(hidden_PF, p["expert_down"])
        in_token_order = jnp.zeros_like(order_P).at[order_P].set(jnp.arange(T * k, dtype=order_P.dtype))
        out_TkD = jnp.take(out_PD, in_token_order, axis=0).reshape(T, k, D)
        out_TD = jnp.einsum("tkd,tk->td", out_TkD, weights_Tk.astype(out_TkD.dtype))
        if self.shared_expert:
            gate_T1 = jax.nn.sigmoid(jnp.einsum("td,d->t", h_TD, p["shared_expert_gate"]))[:, None]
            out_TD = out_TD + gate_T1 * swiglu(h_TD[None], p["w_gate"], p["w_up"], p["w_down"])[0]
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
        params = {"mlp_norm": p["mlp_norm"], "router": p["router"]}
        if not differentiable:
            params, x_BSD = jax.lax.stop_gradient((params, x_BSD))

        def per_device(params, x_BsD):
            params = varying_like(params, x_BsD)
            size = tile or x_BsD.shape[1]

            def one_tile(i, total):
                x_BTD = tile_at(x_BsD, i, size)
                h_TD = rms_norm(x_BTD, params["mlp_norm"], eps).reshape(-1, x_BTD.shape[-1])
                probabilities_TE, _, experts_Tk = route(h_TD, params["router"], top_k=self.top_k,
                                                        normalize=self.normalize)
                return jax.tree.map(jnp.add, total, tile_statistics(probabilities_TE, experts_Tk))

            total = jax.lax.fori_loop(0, x_BsD.shape[1] // size, jax.checkpoint(one_tile),
                                      varying_like(no_statistics(self.num_experts), x_BsD))
            return jax.lax.psum(total, shards.all_axes) if shards.all_axes else total

        return shards.map(per_device, (REPLICATED, HIDDEN), REPLICATED)(params, x_BSD)
