"""Pallas kernel calls inside shard_map, interpreted on the CPU's 8 virtual devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jlong.ops.pallas_calls import kernel_call


def _affine(x_ref, scale_ref, o_ref):
    o_ref[...] = x_ref[...] * scale_ref[...] + 1


@pytest.mark.fast
def test_an_interpreted_kernel_runs_on_each_devices_own_operands_without_collectives():
    """Each device's results come from its own rows (the rows differ from device to device) and from an
    operand that is the same on every device, and the program moves nothing between devices: no
    collective can wait on another (XLA:CPU lets a device's collectives overlap)."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    call = kernel_call(_affine, jax.ShapeDtypeStruct((4, 16), jnp.float32), interpret=True,
                       grid=(2,), in_specs=[pl.BlockSpec((2, 16), lambda i: (i, 0)),
                                            pl.BlockSpec((1, 16), lambda i: (0, 0))],
                       out_specs=pl.BlockSpec((2, 16), lambda i: (i, 0)))
    sharded = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(P(("a", "b")), P()), out_specs=P(("a", "b"))))
    x = jax.device_put(np.arange(32 * 16, dtype=np.float32).reshape(32, 16), NamedSharding(mesh, P(("a", "b"))))
    scale = np.linspace(0.5, 2.0, 16, dtype=np.float32).reshape(1, 16)
    np.testing.assert_array_equal(np.asarray(sharded(x, scale)), np.asarray(x) * scale + 1)
    program = sharded.lower(x, scale).compile().as_text()
    for collective in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in program
