"""MXFP4 tensors as OpenAI publishes GPT-OSS's experts, read back to floats.

A matrix [..., rows, cols] is stored as two tensors (OCP Microscaling
formats, MX v1.0): `NAME_blocks` [..., rows, cols / 32, 16] uint8, each
byte two FP4 (E2M1) values, the low nibble first; and `NAME_scales`
[..., rows, cols / 32] uint8, one E8M0 exponent (biased by 127) per block of
32 values. A value is E2M1(nibble) x 2^(scale - 127).

`dequantize` gives what transformers' `convert_moe_packed_tensors`
(integrations/mxfp4.py) gives: the matrix, then its last two axes swapped,
which is the layout of the model's parameter (`mlp.experts.gate_up_proj`
[E, D, 2F] from blocks stored [E, 2F, D / 32, 16]). Every value is exact in
float32 and in bfloat16 (an FP4 value has at most two significant bits), so
casting the result to the run's parameter dtype loses nothing.
"""

from __future__ import annotations

import numpy as np

from jlong.errors import JlongError

BLOCKS, SCALES = "_blocks", "_scales"  # the suffixes of a quantized tensor's two parts
VALUES_PER_BLOCK = 32
SCALE_BIAS = 127
# E2M1 by its 4-bit code: sign, two exponent bits, one mantissa bit.
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequantized_shape(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    """The parameter's shape [E, cols, rows] from the parts' [E, rows, cols / 32, 16] and [E, rows, cols / 32];
    a one-line error naming `name` for parts that do not fit together."""
    if len(blocks_shape) != 4 or tuple(blocks_shape[:-1]) != tuple(scales_shape) \
            or 2 * blocks_shape[-1] != VALUES_PER_BLOCK:
        raise JlongError(f"MXFP4 tensor {name}: blocks {tuple(blocks_shape)} and scales {tuple(scales_shape)} are "
                         f"not [experts, rows, blocks, {VALUES_PER_BLOCK // 2}] and [experts, rows, blocks]")
    experts, rows, count, width = blocks_shape
    return experts, count * width * 2, rows


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [E, cols, rows] from blocks [E, rows, cols / 32, 16] and scales [E, rows, cols / 32], one
    expert at a time (the intermediates of one expert, not of all)."""
    experts, cols, rows = dequantized_shape(blocks.shape, scales.shape, "")
    out = np.empty((experts, cols, rows), np.float32)
    for e in range(experts):
        packed = np.asarray(blocks[e], np.uint8)
        values = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.float32)  # [rows, cols / 32, 32]
        values[..., 0::2] = FP4_VALUES[packed & 0x0F]
        values[..., 1::2] = FP4_VALUES[packed >> 4]
        exponents = np.asarray(scales[e], np.int32)[..., None] - SCALE_BIAS
        np.ldexp(values, exponents, out=values)
        out[e] = values.reshape(rows, cols).T
    return out
