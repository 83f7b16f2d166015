"""Products inside Pallas Triton kernels, on the tensor cores at every dtype.

16-bit operands go to the tensor cores as they are (float32 sums). Float32
operands (the ring's summaries) would run without them at IEEE precision:
Triton lowers such a product to scalar FMAs, with registers spilled by the
kilobyte at a kernel's [64, 64] tiles. Instead each
operand is cut into two TF32 numbers, x = hi + lo (hi: x's sign, exponent and
top 10 mantissa bits; lo: the same of what is left), and the product is three
TF32 ones, a_hi b_lo + a_lo b_hi + a_hi b_hi: about 2^-20 relative error
where a single TF32 product has 2^-11 (CUTLASS' "3xTF32").

The parts are cut by masking bits, so each is exactly a TF32 number and a
product of two is exact in float32: interpreted on the CPU (whose float32
products are IEEE) the kernel computes the very products the GPU's tensor
cores do, up to the order of the sums. The planner prices such a kernel's
products at `pallas_calls.TRITON_FLOAT32_PRODUCT_COST` times a 16-bit one's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

_TF32_BITS = 0xFFFFE000  # float32's sign, exponent and the 10 mantissa bits TF32 keeps


def _tf32_part(x):
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(_TF32_BITS)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def tf32_parts(x):
    """(hi, lo), TF32 numbers with x = hi + lo to about 2^-21 of x."""
    hi = _tf32_part(x)
    return hi, _tf32_part(x - hi)


def float32_dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """a @ b of float32 tiles as three TF32 products of their parts (module docstring)."""
    (a_hi, a_lo), (b_hi, b_lo) = tf32_parts(a), tf32_parts(b)
    # DEFAULT, not the config's: the tests' "highest" would make each part's product IEEE again
    dot = functools.partial(plgpu.dot, trans_a=trans_a, trans_b=trans_b, precision=jax.lax.Precision.DEFAULT)
    return dot(a_hi, b_lo) + dot(a_lo, b_hi) + dot(a_hi, b_hi)  # the small terms first


def dot_for(operand):
    """The product of tiles in the `operand` dtype, float32 sums: `float32_dot` for float32, Triton's own
    product for 16-bit dtypes."""
    return float32_dot if jnp.dtype(operand) == jnp.float32 else plgpu.dot
