"""The parameter layout's role column decides initialisation and weight decay."""

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import small_config

from jlong.families import Role, family_of
from jlong.model.transformer import Transformer

pytestmark = pytest.mark.fast


def test_roles_decide_initial_values_and_decay():
    config = small_config("model.family=qwen3", "model.attention_bias=true").model
    family = family_of(config)
    params = nnx.to_pure_dict(nnx.state(Transformer(config, rngs=nnx.Rngs(0))))
    mask = family.decay_mask(config, params)
    specs = {**family.outer_params(config), **family.layer_params(config)}
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        name = path[-1].key
        role = specs[name].role
        decayed = mask["layers"][name] if path[0].key == "layers" else mask[name]
        assert decayed == (role in (Role.MATRIX, Role.EMBEDDING)), name
        value = np.asarray(value)
        if role is Role.NORM:
            assert (value == 1).all(), name
        elif role is Role.BIAS:
            assert (value == 0).all(), name
        else:
            assert 0.01 < value.std() < 0.03, name  # INIT_STD = 0.02
    assert {"bq", "bk", "bv", "q_norm", "k_norm", "lm_head"} <= set(specs)
