"""QLoRA's frozen base in 4 bits: NF4 (NormalFloat, QLoRA's data type) with
one absmax scale per block of 64 consecutive inputs of each output, as
bitsandbytes lays out a Linear layer's weight, through qwix's `nf4` arrays.

The codes are stored as uint4, two to a byte, and the scales in the compute
dtype: 4.25 bits a weight, about a quarter of bf16. (bitsandbytes also
quantizes the scales to 8 bits, "double quantization"; here they stay in
the compute dtype.) The error is qwix's quantization, made once, when the
base is loaded; the step dequantizes one layer's weights at a time, after
FSDP has gathered them in 4 bits, and adds no error of its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix

BLOCK = 64  # inputs per scale, bitsandbytes' default blocksize


def block_of(size: int) -> int:
    """The inputs per scale along an axis of `size`: 64, or the largest divisor of size below it."""
    return math.gcd(BLOCK, size)


def quantize(w_LIO, inputs: int, dtype) -> qwix.QArray:
    """A layer-stacked weight [layers, *inputs, *outputs] in NF4, blocks
    along its last input axis, one layer at a time (bounded temporaries)."""
    axis = inputs - 1  # the last input axis of one layer's [*inputs, *outputs]
    block = block_of(w_LIO.shape[1 + axis])

    def one_layer(w):
        others = tuple(i for i in range(w.ndim) if i != axis)
        return qwix.quantize(w.astype(jnp.float32), "nf4", channelwise_axes=others, tiled_axes={axis: block},
                             scale_dtype=dtype)

    return jax.lax.map(one_layer, w_LIO)


def dequantize(w: qwix.QArray, dtype):
    return qwix.dequantize(w).astype(dtype)


def is_quantized(w) -> bool:
    return isinstance(w, qwix.QArray)
