"""Grouped matmuls: rows sorted into consecutive groups, each group
multiplied by its own matrix, [M, K] x [G, K, N] -> [M, N], group g being
the next group_sizes[g] rows.

`KERNELS` holds them by name (setting `kernels.grouped_matmul`;
`MixtureOfExperts.kernel`); `kernel_for` is what `auto` picks on a platform,
and `matmul` a kernel ready to call there (a GPU kernel on the CPU runs in
its interpreter):

- `ragged_dot`: `jax.lax.ragged_dot`, XLA's own: what the CPU runs, and the
  reference. XLA:GPU in jax 0.10 lowers it to a product with every group's
  matrix (G times the FLOPs), so GPUs run
- `triton`: Pallas Triton kernels over tiles of sorted rows
  (`jlong.moe.grouped_matmul_triton`), FLOPs for the rows each group has;
  what `auto` runs on a GPU (the kernel raced: experiments/kernel_race.py)
  while jax has Pallas' Triton backend (listed only then);
- `mosaic`: the same work as Pallas Mosaic GPU kernels for Hopper
  (`jlong.moe.grouped_matmul_mosaic`; TMA and wgmma, bf16 or f16 operands):
  the route that stays once jax removes Pallas' Triton backend, and what
  `auto` runs on a GPU after.
"""

from __future__ import annotations

import functools

import jax

from jlong.moe import grouped_matmul_mosaic
from jlong.ops.pallas_calls import has_pallas_triton


def ragged_dot(x_MK, w_GKN, group_sizes_G):
    """Rows [M, K] by their groups' matrices [G, K, N]; group sizes [G] int32 summing to M."""
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)


KERNELS = {"ragged_dot": ragged_dot, "mosaic": grouped_matmul_mosaic.grouped_matmul}
GPU_KERNELS = frozenset({"triton", "mosaic"})  # written for a GPU; `interpret=True` runs them anywhere
GPU_ONLY_IN_MODELS = frozenset()  # every kernel here also runs interpreted in a model (one device)
PRICED_CALLS = ((grouped_matmul_mosaic.call_flops, "grouped matmul (mosaic)"),)  # for the planner
if has_pallas_triton():  # a jax without Pallas' Triton backend runs the Mosaic GPU kernel
    from jlong.moe import grouped_matmul_triton

    KERNELS["triton"] = grouped_matmul_triton.grouped_matmul
    PRICED_CALLS = ((grouped_matmul_triton.call_flops, "grouped matmul"), *PRICED_CALLS)


def kernel_for(platform: str) -> str:
    """The grouped matmul `auto` runs on `platform` ("gpu" or "cpu"): the raced Triton kernel while jax
    has Pallas' Triton backend, the Mosaic GPU one after."""
    if platform != "gpu":
        return "ragged_dot"
    return "triton" if "triton" in KERNELS else "mosaic"


def matmul(name: str, *, interpret: bool = False):
    """The kernel `name`, interpreted when `interpret` and it is a GPU kernel."""
    kernel = KERNELS[name]
    return functools.partial(kernel, interpret=True) if interpret and name in GPU_KERNELS else kernel
