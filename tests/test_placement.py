"""The placement table: activations by batch and sequence, parameters split
over every device along their first divisible weight axis, unknown axes refused."""

import pytest
from jax.sharding import PartitionSpec as P

from jlong.ops.shards import HIDDEN, TOKENS
from jlong.parallel.placement import MESH_AXES, compute_spec, rest_spec

pytestmark = pytest.mark.fast  # every test here is quick: the fast tier (pytest -m fast)


def test_activations_split_batch_over_data_fsdp_and_sequence_over_ring_and_sp():
    assert compute_spec(TOKENS) == P(("data", "fsdp"), ("ring", "sp"))
    assert compute_spec(HIDDEN) == P(("data", "fsdp"), ("ring", "sp"), None)


def test_weights_are_gathered_at_compute():
    assert compute_spec(("layers", "embed", "heads", "head_dim")) == P(None, None, None, None)


@pytest.mark.parametrize(
    "shape, axes, expected",
    [
        ((4096, 32, 128), ("embed", "heads", "head_dim"), P(MESH_AXES, None, None)),
        ((32, 4100, 14336), ("layers", "embed", "mlp"), P(None, None, MESH_AXES)),  # embed does not divide: mlp
        ((32, 128, 4100), ("heads", "head_dim", "embed"), P(MESH_AXES, None, None)),  # heads before nothing
        ((4100,), ("embed",), P()),  # nothing divides: replicated
        ((128256, 4096), ("vocab", "embed"), P(None, MESH_AXES)),  # the table prefers embed to vocab
    ],
)
def test_parameters_rest_split_along_the_first_divisible_axis_of_the_table(shape, axes, expected):
    assert rest_spec(shape, axes, 8) == expected


def test_an_unknown_logical_axis_is_an_error_not_replication():
    with pytest.raises(ValueError, match="unknown logical axis 'embd'"):
        compute_spec(("batch", "embd"))
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        rest_spec((64,), ("hidden",), 8)
