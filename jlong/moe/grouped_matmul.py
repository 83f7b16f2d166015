"""Grouped matmuls: rows sorted into consecutive groups, each group
multiplied by its own matrix, [M, K] x [G, K, N] -> [M, N], group g being
the next group_sizes[g] rows.

`KERNELS` holds them by name (setting `kernels.grouped_matmul`;
`MixtureOfExperts.kernel`); `kernel_for` is what `auto` picks on a platform:
on a GPU the first of `GPU_PREFERENCE` whose GPU kernels have all run on a
GPU (`jlong.kernel_runs`; the others are chosen by name only); `matmul` a
kernel ready to call there (a GPU kernel on the CPU runs in its
interpreter):

- `ragged_dot`: `jax.lax.ragged_dot`, XLA's own: what the CPU runs, and the
  reference. XLA:GPU in jax 0.10 lowers it to a product with every group's
  matrix (G times the FLOPs), so GPUs run
- `triton`: Pallas Triton kernels over tiles of sorted rows
  (`jlong.moe.grouped_matmul_triton`), FLOPs for the rows each group has;
  listed while jax has Pallas' Triton backend;
- `mosaic`: the same work as Pallas Mosaic GPU kernels for Hopper
  (`jlong.moe.grouped_matmul_mosaic`; TMA and wgmma, bf16 or f16 operands):
  the route that stays once jax removes Pallas' Triton backend.
"""

from __future__ import annotations

import functools

import jax

from jlong import kernel_runs
from jlong.moe import grouped_matmul_mosaic
from jlong.ops.pallas_calls import has_pallas_triton


def ragged_dot(x_MK, w_GKN, group_sizes_G):
    """Rows [M, K] by their groups' matrices [G, K, N]; group sizes [G] int32 summing to M."""
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)


KERNELS = {"ragged_dot": ragged_dot, "mosaic": grouped_matmul_mosaic.grouped_matmul}
GPU_KERNELS = frozenset({"triton", "mosaic"})  # written for a GPU; `interpret=True` runs them anywhere
GPU_ONLY_IN_MODELS = frozenset()  # every kernel here also runs interpreted in a model (one device)
# The GPU kernels each of KERNELS runs, by their names in a compiled program (ragged_dot runs XLA's alone).
GPU_KERNEL_NAMES = {"mosaic": (grouped_matmul_mosaic.PRODUCT, grouped_matmul_mosaic.WEIGHT_GRADIENT)}
# What `auto` runs on a GPU: the first of these whose GPU kernels have all run on a GPU.
GPU_PREFERENCE = ("triton", "mosaic", "ragged_dot")
PRICED_CALLS = ((grouped_matmul_mosaic.call_flops, "grouped matmul (mosaic)"),)  # for the planner
if has_pallas_triton():  # the Triton kernels, while jax has Pallas' Triton backend
    from jlong.moe import grouped_matmul_triton

    KERNELS["triton"] = grouped_matmul_triton.grouped_matmul
    GPU_KERNEL_NAMES["triton"] = (grouped_matmul_triton.PRODUCT, grouped_matmul_triton.WEIGHT_GRADIENT)
    PRICED_CALLS = ((grouped_matmul_triton.call_flops, "grouped matmul"), *PRICED_CALLS)


def kernel_for(platform: str, runs: kernel_runs.KernelRuns | None = None) -> str:
    """The grouped matmul `auto` runs on `platform` ("gpu" or "cpu"): on a GPU the first of `GPU_PREFERENCE`
    listed here whose GPU kernels have all run on a GPU (`runs`, by default the committed record);
    `ragged_dot` elsewhere."""
    if platform != "gpu":
        return "ragged_dot"
    runs = runs or kernel_runs.recorded()
    return next(name for name in GPU_PREFERENCE if name in KERNELS and runs.ran(GPU_KERNEL_NAMES.get(name, ())))


def matmul(name: str, *, interpret: bool = False):
    """The kernel `name`, interpreted when `interpret` and it is a GPU kernel."""
    kernel = KERNELS[name]
    return functools.partial(kernel, interpret=True) if interpret and name in GPU_KERNELS else kernel
