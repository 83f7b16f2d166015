"""QLoRA's frozen base in 4 bits: NF4 (NormalFloat, QLoRA's data type) with
one absmax scale per block of 64 consecutive inputs of each output, as
bitsandbytes lays out a Linear layer's weight, through qwix's `nf4` arrays.

The codes are stored two to a byte (uint8, packed along the weight's last
axis), and the scales in the compute dtype: 4.25 bits a weight, about a quarter of bf16. (bitsandbytes also
quantizes the scales to 8 bits, "double quantization"; here they stay in
the compute dtype.) The error is qwix's quantization, made once, when the
base is loaded; the step dequantizes one layer's weights at a time, after
FSDP has gathered them in 4 bits, and adds no error of its own.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import qwix

from jlong.errors import JlongError

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

    if w_LIO.shape[-1] % 2:
        raise JlongError(f"lora.base_dtype=nf4 packs two codes to a byte along a weight's last axis; a weight of "
                         f"shape {list(w_LIO.shape[1:])} has an odd one: use lora.base_dtype=compute")
    quantized = jax.lax.map(one_layer, w_LIO)
    return dataclasses.replace(quantized, qvalue=_packed(quantized.qvalue))


def dequantize(w: qwix.QArray, dtype):
    return qwix.dequantize(dataclasses.replace(w, qvalue=_unpacked(w.qvalue))).astype(dtype)


def _packed(codes):
    """uint4 codes [..., n] as uint8 [..., n / 2], two to a byte (the first in the low half). Packed
    by hand, not left to XLA's uint4 layout, which a compiled step and the arrays it is given may not
    share (on the CPU they do not)."""
    codes = codes.astype(jnp.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpacked(packed):
    low, high = packed & 0xF, packed >> 4
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1).astype(jnp.uint4)


def is_quantized(w) -> bool:
    return isinstance(w, qwix.QArray)
