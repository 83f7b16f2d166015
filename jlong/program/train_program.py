"""The training program of a config on a mesh: the one object that knows the
parameters' layout, the optimizer, the batch layout and the jitted step.

The loop runs it, the planner compiles it (`jlong.planner.memory`), the out-of-memory
report plans it, and the tests check it; nothing else builds a train step.
Parameters travel as a plain nested dict of arrays (what `nnx.to_pure_dict`
gives); `bind` turns one back into a `Transformer` inside traced code.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from jlong.config import Config
from jlong.data.sources import batch_layout
from jlong.families import family_of
from jlong.model.transformer import ForwardOptions, Transformer
from jlong.parallel.placement import MeshShards, batch_sharding, replicated, rest_spec
from jlong.attention.methods import method_of
from jlong.program.host_optimizer import HostAdamW
from jlong.program.optimizer import DeviceAdamW, Optimizer


def make_optimizer(config: Config) -> Optimizer:
    """The run's optimizer: in host memory with `memory.optimizer_offload`, else on the devices."""
    kind = HostAdamW if config.memory.optimizer_offload else DeviceAdamW
    return kind(config.train, functools.partial(family_of(config.model).decay_mask, config.model))


def _with_shardings(shapes, shardings):
    def placed(s, sharding):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    return jax.tree.map(placed, shapes, shardings)


class TrainProgram:
    """(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm}),
    jitted over `mesh` with donated parameters and optimizer state."""

    def __init__(self, config: Config, mesh):
        self.config, self.mesh = config, mesh
        self.options = ForwardOptions.for_training(config, MeshShards(mesh), mesh.devices.flat[0].platform)
        abstract_model = nnx.eval_shape(lambda: self._fresh_model(0))
        self.graphdef, self._abstract_state = nnx.split(abstract_model)
        self.param_shardings = self._param_shardings()  # on the devices, where the step computes with them
        param_shapes = nnx.to_pure_dict(self._abstract_state)

        self.optimizer = make_optimizer(config)
        self.rest_shardings = self.optimizer.rest_shardings(self.param_shardings)  # between steps
        opt_shapes = jax.eval_shape(self.optimizer.init, param_shapes)
        self.opt_shardings = self.optimizer.state_shardings(opt_shapes, self.rest_shardings, replicated(mesh))
        self.abstract_params = _with_shardings(param_shapes, self.rest_shardings)
        self.abstract_opt_state = _with_shardings(opt_shapes, self.opt_shardings)
        # What the forward and backward passes hold on each device.
        compute_dtype = config.train.compute_dtype if self.optimizer.makes_compute_copy else None
        self.abstract_compute_params = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, compute_dtype or s.dtype, sharding=sharding),
            param_shapes, self.param_shardings,
        )

        self.batch_sharding = batch_sharding(mesh)
        self.abstract_batch = {
            key: jax.ShapeDtypeStruct(shape, dtype, sharding=self.batch_sharding)
            for key, (shape, dtype) in batch_layout(config).items()
        }
        self.step = jax.jit(
            self._step,
            in_shardings=(self.rest_shardings, self.opt_shardings, self.batch_sharding),
            out_shardings=(self.rest_shardings, self.opt_shardings, replicated(mesh)),  # every metric whole
            donate_argnums=(0, 1),
        )
        # Forward only: (params, batch) -> [B, S, 2] per-token cross-entropy and argmax hits (`jlong.eval`).
        self.eval_step = jax.jit(self._token_scores, in_shardings=(self.rest_shardings, self.batch_sharding),
                                 out_shardings=self.batch_sharding)

    def _fresh_model(self, seed: int) -> Transformer:
        return Transformer(
            self.config.model, rngs=nnx.Rngs(seed), param_dtype=self.config.train.param_dtype, options=self.options
        )

    def _param_shardings(self) -> dict:
        shardings: dict = {}
        for path, variable in nnx.to_flat_state(self._abstract_state):
            shape = variable.get_value().shape
            node = shardings
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = NamedSharding(self.mesh, rest_spec(shape, variable.axes, self.mesh.size))
        return shardings

    # -- parameters and optimizer state

    def init_params(self, seed: int) -> dict:
        """Random initial parameters, created directly in their shards."""
        init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(self._fresh_model(seed))), out_shardings=self.rest_shardings)
        return init()

    def load_hf_params(self, path: str) -> dict:
        """A Hugging Face checkpoint's weights, read shard by shard into their places."""
        from jlong.hf import load_hf_params

        on_devices = _with_shardings(self.abstract_params, self.param_shardings)
        params = load_hf_params(path, self.config.model, on_devices)
        return jax.device_put(params, self.rest_shardings, donate=True)

    def init_opt_state(self, params: dict):
        return jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(params)

    def bind(self, params: dict) -> Transformer:
        state = jax.tree.map(lambda v: v, self._abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    # -- the step

    def loss(self, params: dict, batch: dict):
        """The model's training loss of a batch placed by `place_batch`."""
        return self.bind(params).loss(batch)

    def _loss_and_metrics(self, params: dict, batch: dict):
        return self.bind(params).loss_and_metrics(batch)

    def _step(self, params, opt_state, batch):
        """One optimizer step: the metrics are the loss, the gradient's norm and the model's own
        (`Transformer.loss_and_metrics`)."""
        compute_params = self.optimizer.compute_params(params, self.param_shardings)
        (loss, metrics), grads = jax.value_and_grad(self._loss_and_metrics, has_aux=True)(compute_params, batch)
        params, opt_state, grad_norm = self.optimizer.update(grads, opt_state, params)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, **metrics}

    def _token_scores(self, params, batch):
        return self.bind(self.optimizer.compute_params(params, self.param_shardings)).token_scores(batch)

    def lower_eval(self) -> jax.stages.Lowered:
        """The forward-only program of `eval_step`, lowered for abstract parameters and batch."""
        return self.eval_step.lower(self.abstract_params, self.abstract_batch)

    def lower(self) -> jax.stages.Lowered:
        """The step lowered for the abstract parameters, state and batch: the
        same program whatever values later run through it."""
        return self.step.lower(self.abstract_params, self.abstract_opt_state, self.abstract_batch)

    def compile(self, compiler_options: dict | None = None) -> jax.stages.Compiled:
        return self.lower().compile(compiler_options=compiler_options)

    def place_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """The global numpy batch -> arrays sharded over the mesh, laid out
        along the sequence as the model computes on it (zigzag over a ring;
        each process builds only the shards its devices hold)."""
        layout = method_of(self.config).layout(self.config)
        placed = {}
        for key, value in batch.items():
            laid_out = layout.lay_out(value)
            placed[key] = jax.make_array_from_callback(
                value.shape, self.batch_sharding, functools.partial(_index, laid_out)
            )
        return placed


def _index(array: np.ndarray, index):
    return array[index]
