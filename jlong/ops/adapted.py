"""A frozen weight and its low-rank update, as the layers compute with it.

`Adapted(w, a, b)` stands for w + a @ b without ever forming it: w has
`inputs` leading input axes and then its output axes (jlong's layout,
[D, H, d] for a query projection, [H, d, D] for the output projection);
a is [*input axes, r], b is [r, *output axes], already scaled by alpha / r.
x @ w becomes x @ w + (x @ a) @ b, so the backward pass never forms the
weight gradient x^T dy of the frozen w: only the adapters' thin ones.

The layers take a weight apart before they multiply by it (a range of
heads, a split of a fused projection, a reshape) and put pieces together
(q, k and v in one matmul). `on_outputs` and `on_inputs` apply such a
change to a plain array or to an `Adapted` alike; `concatenate` joins
pieces along an output axis, their a's side by side and their b's block
diagonal (exact: the zero blocks add nothing); `matmul` multiplies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jlong.ops.tiling import varying_like


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Adapted:
    w: jax.Array
    a: jax.Array
    b: jax.Array
    inputs: int = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape


def _rebuilt(like: Adapted, ws, sides, side: str):
    """`like` with w and one side replaced, piece by piece when fn made several."""
    if isinstance(ws, (tuple, list)):
        return type(ws)(_rebuilt(like, w, s, side) for w, s in zip(ws, sides))
    return dataclasses.replace(like, w=ws, **{side: sides})


def on_outputs(fn: Callable, w):
    """fn applied to a weight's output axes (the trailing ones: fn must treat
    the leading axes as a batch, e.g. slice or split along an axis counted
    from the end, or reshape by the array's own leading size)."""
    if not isinstance(w, Adapted):
        return fn(w)
    return _rebuilt(w, fn(w.w), fn(w.b), "b")


def on_inputs(fn: Callable, w):
    """fn applied to a weight's input axes (the leading ones, the trailing
    kept as they are: e.g. a range of heads of the output projection)."""
    if not isinstance(w, Adapted):
        return fn(w)
    return _rebuilt(w, fn(w.w), fn(w.a), "a")


def concatenate(pieces: list, axis: int):
    """Weights with the same input axes joined along output axis `axis` (of w)."""
    adapted = [p for p in pieces if isinstance(p, Adapted)]
    w = jnp.concatenate([p.w if isinstance(p, Adapted) else p for p in pieces], axis=axis)
    if not adapted:
        return w
    inputs = adapted[0].inputs
    b_axis = axis - inputs + 1  # the same output axis in b = [r, *outputs]
    sizes = [p.shape[axis] for p in pieces]
    blocks, start = [], 0
    for piece, size in zip(pieces, sizes):
        if isinstance(piece, Adapted):
            padding = [(0, 0)] * piece.b.ndim
            padding[b_axis] = (start, sum(sizes) - start - size)
            blocks.append(jnp.pad(piece.b, padding))
        start += size
    return Adapted(w, jnp.concatenate([p.a for p in adapted], axis=-1), jnp.concatenate(blocks, axis=0), inputs)


def matmul(x, w, inputs: int):
    """x [..., *input axes] times w: [..., *output axes].

    With adapters, x @ w + (x @ a) @ b. Where the inputs are narrower than the
    outputs (an output projection of a few heads: [S, U d] -> [S, D]), one
    product [x | x @ a] @ [w ; b] makes a single output where two would be
    live before their sum; the copy of x it makes is the smaller buffer, and
    its backward forms no gradient of w. Elsewhere (x [S, D] in), the two
    products: copying x would cost more."""
    if not isinstance(w, Adapted):
        return jnp.tensordot(x, w, axes=inputs)
    low = jnp.tensordot(x, w.a, axes=inputs)
    in_shape, out_shape = w.w.shape[:inputs], w.w.shape[inputs:]
    if math.prod(in_shape) >= math.prod(out_shape):
        return jnp.tensordot(x, w.w, axes=inputs) + jnp.tensordot(low, w.b, axes=1)
    batch = x.shape[:x.ndim - inputs]
    frozen, b = varying_like((w.w.reshape(-1, *out_shape), w.b.astype(w.w.dtype)), x)  # db: this device's part
    return _joined_matmul(x.reshape(*batch, -1), low.astype(x.dtype), frozen, b)


@jax.custom_vjp
def _joined_matmul(x, low, w, b):
    """[x | low] @ [w ; b], x [..., K], low [..., r], w [K, *out], b [r, *out]."""
    return jnp.tensordot(jnp.concatenate([x, low], axis=-1), jnp.concatenate([w, b], axis=0), axes=1)


def _joined_matmul_forward(x, low, w, b):
    return _joined_matmul(x, low, w, b), (low, w, b)


def _joined_matmul_backward(residuals, dy):
    """dx = dy w^T and dlow = dy b^T apart (one joined product would need a joined buffer and two slices of
    it), db from low, and no gradient of the frozen w (autodiff of the joined product would form all of
    [w ; b]'s, x^T dy included, and drop w's part)."""
    low, w, b = residuals
    out_axes = tuple(range(1, w.ndim))
    dy_axes = tuple(range(dy.ndim - len(out_axes), dy.ndim))
    dx = jnp.tensordot(dy, w, axes=(dy_axes, out_axes)).astype(low.dtype)
    dlow = jnp.tensordot(dy, b, axes=(dy_axes, out_axes)).astype(low.dtype)
    batch_axes = tuple(range(low.ndim - 1))
    db = jnp.tensordot(low, dy, axes=(batch_axes, batch_axes)).astype(b.dtype)
    return dx, dlow, None, db


_joined_matmul.defvjp(_joined_matmul_forward, _joined_matmul_backward)
