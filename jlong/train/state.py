"""Building the model and its parameters, sharded, without a full copy anywhere.

Parameters travel through training as a plain nested dict of arrays (what
`nnx.to_pure_dict` gives); `Model.bind` turns such a dict back into a
`Transformer` inside traced code.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jlong.attention.kernels import choose_kernel
from jlong.config import Config
from jlong.model.transformer import ForwardOptions, Transformer
from jlong.parallel.mesh import param_spec


def forward_options(config: Config, platform: str) -> ForwardOptions:
    """The forward pass on `platform` (the mesh's: "gpu" or "cpu"), where
    `attention.impl=auto` becomes the kernel that platform runs."""
    return ForwardOptions(
        compute_dtype=config.train.compute_dtype,
        attention_impl=choose_kernel(
            config.attention.impl, platform=platform, dtype=config.train.compute_dtype,
            seq_len=config.train.seq_len, head_dim=config.model.dim_per_head, packed=config.data.eos_id is not None,
        ),
        block_size=config.attention.block_size,
        heads_per_stage=config.heads_per_stage,
        remat=config.memory.remat,
        mlp_tile=config.memory.mlp_tile,
    )


class Model:
    """The model's structure (no values) and how its parameters are placed."""

    def __init__(self, config: Config, mesh):
        self.config, self.mesh = config, mesh
        self.platform = mesh.devices.flat[0].platform
        self.abstract = nnx.eval_shape(lambda: self._fresh(0))
        self.graphdef, self.abstract_state = nnx.split(self.abstract)
        self.shardings = self._param_shardings()

    def _fresh(self, seed: int) -> Transformer:
        return Transformer(
            self.config.model,
            rngs=nnx.Rngs(seed),
            param_dtype=self.config.train.param_dtype,
            options=forward_options(self.config, self.platform),
        )

    def _param_shardings(self) -> dict:
        specs = {}
        for path, variable in nnx.to_flat_state(self.abstract_state):
            spec = param_spec(variable.get_value().shape, variable.axes, self.mesh)
            node = specs
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = NamedSharding(self.mesh, spec)
        return specs

    def abstract_params(self) -> dict:
        """ShapeDtypeStructs with shardings: for restoring and ahead-of-time compiles."""
        shapes = nnx.to_pure_dict(self.abstract_state)
        return jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
            shapes,
            self.shardings,
        )

    def init_params(self, seed: int) -> dict:
        """Random initial parameters, created directly in their shards."""
        init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(self._fresh(seed))), out_shardings=self.shardings)
        return init()

    def load_hf_params(self, path: str) -> dict:
        from jlong.hf import from_hf

        model = from_hf(path, param_dtype=self.config.train.param_dtype)
        return jax.device_put(nnx.to_pure_dict(nnx.state(model)), self.shardings)

    def bind(self, params: dict) -> Transformer:
        state = jax.tree.map(lambda v: v, self.abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)
