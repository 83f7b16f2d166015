"""jlong.ops.triton_dots: float32 products inside Pallas Triton kernels as three TF32 ones, the same
products on the CPU's interpreter as on the GPU's tensor cores."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax.experimental.pallas.triton")

from jax.experimental.pallas import triton as plgpu  # noqa: E402

from jlong.ops.pallas_calls import kernel_call  # noqa: E402
from jlong.ops.triton_dots import dot_for, float32_dot, tf32_parts  # noqa: E402

pytestmark = pytest.mark.fast
_LOW_BITS = 0x1FFF  # the 13 mantissa bits float32 has beyond TF32's 10


def _bits(x):
    return np.asarray(x).view(np.uint32)


def test_each_part_is_a_tf32_number_and_the_two_add_up_to_the_float32_one():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)) * 10.0 ** np.arange(-3, 5)[:, None].repeat(8, 0),
                    jnp.float32)
    hi, lo = tf32_parts(x)
    assert not (_bits(hi) & _LOW_BITS).any() and not (_bits(lo) & _LOW_BITS).any()
    assert (np.abs(np.asarray(hi)) <= np.abs(np.asarray(x))).all()  # hi is x truncated
    error = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - np.asarray(x, np.float64))
    assert (error <= 2.0**-21 * np.abs(np.asarray(x, np.float64))).all()


def _interpreted(dot, a, b, **transposes):
    def kernel(a_ref, b_ref, out_ref):
        out_ref[...] = dot(plgpu.load(a_ref), plgpu.load(b_ref), **transposes)

    rows = a.shape[1] if transposes.get("trans_a") else a.shape[0]
    columns = b.shape[0] if transposes.get("trans_b") else b.shape[1]
    return kernel_call(kernel, jax.ShapeDtypeStruct((rows, columns), jnp.float32), interpret=True)(a, b)


@pytest.mark.parametrize("transposes", [{}, {"trans_a": True}, {"trans_b": True}], ids=["ab", "aTb", "abT"])
def test_a_float32_product_in_a_kernel_is_within_2_to_the_minus_19_of_the_exact_one(transposes):
    """Three TF32 products leave out lo x lo (2^-20 of each term) and lose what falls below TF32 in lo:
    within 2^-19 of sum |a| |b| (float32 sums add ~2^-24 x 64), where one TF32 product of the parts'
    highs alone misses by up to 2^-10 and fails."""
    rng = np.random.default_rng(1)
    a, b = (jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for _ in range(2))
    A, Bm = np.asarray(a, np.float64), np.asarray(b, np.float64)
    A, Bm = (A.T if transposes.get("trans_a") else A), (Bm.T if transposes.get("trans_b") else Bm)
    exact, scale = A @ Bm, np.abs(A) @ np.abs(Bm)

    def error(dot):
        return np.max(np.abs(np.asarray(_interpreted(dot, a, b, **transposes), np.float64) - exact) / scale)

    assert error(float32_dot) < 2.0**-19
    one_tf32 = lambda x, y, **t: plgpu.dot(tf32_parts(x)[0], tf32_parts(y)[0], **t)  # noqa: E731
    assert error(one_tf32) > 2.0**-14


def test_16_bit_operands_take_the_tensor_cores_product_as_it_is():
    assert dot_for(jnp.bfloat16) is plgpu.dot and dot_for(jnp.float16) is plgpu.dot
    assert dot_for(jnp.float32) is float32_dot
