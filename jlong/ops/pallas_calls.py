"""Pallas kernel calls that work on every mesh and, interpreted, on the CPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jlong.errors import JlongError


def has_pallas_triton() -> bool:
    """Whether this jax has Pallas' Triton backend (deprecated since jax 0.11,
    to be removed): the kernel registries list their Triton kernels only then."""
    try:
        import jax.experimental.pallas.triton  # noqa: F401
    except ImportError:
        return False
    return True


TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call XLA:GPU runs a Pallas Triton kernel as
# What a float32 product costs jlong's Triton kernels beside a 16-bit one of the same shape (for the planner),
# from an H100 SXM's data sheet (989.4 dense bf16 TFLOP/s): as three TF32 products (`jlong.ops.triton_dots`),
# each at TF32's 494.7; at IEEE precision, as Triton's scalar FMAs at 66.9 (registers spilled aside).
TRITON_FLOAT32_PRODUCT_COST = 6
TRITON_IEEE_PRODUCT_COST = 989.4 / 66.9


def triton_kernel_name(target: str, attributes: str) -> str | None:
    """The name of the Pallas Triton kernel a compiled program's custom call runs (from its target and
    attributes as the HLO text prints them), if it runs one: how the planner knows jlong's kernels."""
    names = re.findall(r'name = "([^"]+)", num_stages', attributes or "")
    return names[-1] if target == TRITON_CALL and names else None


def pipeline_stages(stages: int, dtype) -> int:
    """Triton's pipeline stages for a kernel whose loads are `dtype`: `stages`
    for 16-bit operands, one for wider ones (float32 tiles are twice the bytes a
    stage, and at the stages tuned for bf16 ask more shared memory than a
    Hopper SM has)."""
    return stages if jnp.dtype(dtype).itemsize <= 2 else 1


def kernel_call(kernel, out_shape, *, interpret: bool, **params):
    """`pl.pallas_call(kernel, out_shape=...)` as a function of its operands
    that works inside `shard_map` too: there the operands are marked as
    varying over every mesh axis any of them varies over, and so are the
    results (a kernel's results must say how they vary).

    `interpret=True` runs the kernel in Pallas' interpreter. jax 0.10's
    interpreter cannot work on data that varies over a mesh (its discharge
    rules mix it with constants that do not), so inside `shard_map` each
    device's operands are handed over retyped as the same on every device
    (`_retyped_invariant`), the interpreted kernel runs on them and its
    results are marked varying again: each device runs the kernel on its own
    operands, as on a GPU, and no collective is involved."""

    def call(*operands):
        axes = _varying_axes(operands)
        if not axes:
            return pl.pallas_call(kernel, out_shape=out_shape, interpret=interpret, **params)(*operands)
        operands = [_varying(x, axes) for x in operands]
        if not interpret:
            return pl.pallas_call(kernel, out_shape=_typed_like(out_shape, operands[0]), **params)(*operands)
        local = [_retyped_invariant(x) for x in operands]
        results = pl.pallas_call(kernel, out_shape=_typed_like(out_shape, local[0]), interpret=True, **params)(*local)
        return jax.tree.map(lambda r: _varying(r, axes), results)

    return call


def mosaic_kernel_call(body, out_type, *, interpret: bool, **params):
    """`plgpu.kernel(body, out_type=...)` (a Pallas Mosaic GPU kernel) as a
    function of its operands that works inside `shard_map` too. Mosaic GPU
    kernels do not check how values vary over a mesh, so their results come
    out marked the same on every device: they are marked varying over every
    mesh axis any operand varies over, as they are (each device's own).

    `interpret=True` runs the kernel in Mosaic GPU's interpreter (its
    `InterpretGPUParams`, private in jax 0.10) on the CPU, on one device:
    inside `shard_map` over several devices the interpreter (jax 0.10) takes
    the kernel for one over all of them, and its simulated GPUs break or wait
    for each other, so that is refused in one line. Interpreted, run it in
    one jitted program and wait for its results before dispatching more: the
    interpreter's host callbacks run jax computations of their own, which
    jax 0.10's CPU client queues behind work dispatched after the kernel, and
    about 30 of those (an eager loss around the kernel) hang it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jlong.jax_private import private

    settings = private("jax._src.pallas.mosaic_gpu.interpret.params", "InterpretGPUParams")() if interpret else None
    kernel = plgpu.kernel(body, out_type=out_type, interpret=settings, **params)

    def call(*operands):
        axes = _varying_axes(operands)
        if not axes:
            return kernel(*operands)
        if interpret and jax.lax.psum(1, axes) > 1:
            raise JlongError(f"a Mosaic GPU kernel runs in its interpreter on one device, not inside shard_map "
                             f"over {jax.lax.psum(1, axes)} (jax {jax.__version__}'s interpreter): interpret it on "
                             "one device, or pick the Triton kernel to interpret on a mesh")
        return jax.tree.map(lambda r: _varying(r, axes), kernel(*operands))

    return call


def mosaic_smem_layout(block_minor: int, dtype) -> tuple:
    """Mosaic GPU's shared-memory tiling and swizzle for tiles whose minor
    dimension is `block_minor` elements: the widest swizzle that row fills,
    as wgmma and TMA read them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(block_minor * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _varying_axes(operands) -> tuple[str, ...]:
    """The mesh axes any of the operands varies over, sorted."""
    return tuple(sorted(frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in operands))))


def _retyped_invariant(x):
    """x, typed as the same on every device though it is each device's own: an identity on the host
    (`pure_callback`), whose results jax 0.10 types as the same on every device whatever they are given.

    Not a gather: jax 0.10 gives every collective inside `shard_map` the same
    channel, and XLA:CPU lets a device start one collective before the last
    has finished, so two of them waiting at once on a device join each
    other's rendezvous (a CHECK failure) or, with XLA's threads all waiting,
    hang; gathers for interpreted kernels made that common in tests. Costs:
    jax does not keep programs with host callbacks in its persistent
    compilation cache, and takes no callback inside a `shard_map` that leaves
    some mesh axes automatic (jlong's are manual over every axis)."""
    invariant = type(jax.typeof(x).manual_axis_type)()
    return jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype, manual_axis_type=invariant), x,
                             vmap_method="expand_dims")


def _typed_like(out_shape, x):
    """The results' shapes, varying over the mesh as x does."""
    manual = jax.typeof(x).manual_axis_type
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=manual), out_shape)


def _varying(x, axes: tuple[str, ...]):
    """x marked as varying over `axes` (those it does not already vary over)."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x
