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
from jlong.checkpoint import Checkpoints
from jlong.families import family_of
from jlong.model.transformer import ForwardOptions, Transformer
from jlong.model.document_sums import DOCUMENTS
from jlong.objectives import objective_of
from jlong.parallel.placement import MeshShards, batch_sharding, compute_sharding, replicated, rest_spec
from jlong.attention.methods import method_of
from jlong.program.frozen_base import FrozenBase
from jlong.lora.targets import lora_settings
from jlong.program.host_optimizer import HostAdamW
from jlong.init_from import InitialWeights, SETTING as INIT_FROM, check_init_from
from jlong.program.optimizer import DeviceAdamW, Optimizer


def make_optimizer(config: Config, frozen_base: FrozenBase | None = None) -> Optimizer:
    """The run's optimizer: in host memory with `memory.optimizer_offload`, else on the devices; of a
    LoRA run's adapters alone, with `frozen_base`."""
    if frozen_base:
        return DeviceAdamW(config.train, frozen_base.decays)
    kind = HostAdamW if config.memory.optimizer_offload else DeviceAdamW
    return kind(config.train, functools.partial(family_of(config.model).decay_mask, config.model))


TOKEN_ARRAYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")  # what a forward pass reads


def _with_shardings(shapes, shardings):
    def placed(s, sharding):
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    return jax.tree.map(placed, shapes, shardings)


class TrainProgram:
    """(params, opt_state, batch) -> (params, opt_state, {loss, grad_norm}),
    jitted over `mesh` with donated parameters and optimizer state.

    A LoRA run (`config.lora`) trains its adapters alone: the step
    differentiates them only, the optimizer's state is theirs, and a
    checkpoint holds them (`saved`); the frozen base passes through the step
    unchanged, in the compute dtype or in NF4 (`jlong.program.frozen_base`)."""

    def __init__(self, config: Config, mesh):
        self.config, self.mesh = config, mesh
        self.options = ForwardOptions.for_training(config, MeshShards(mesh), mesh.devices.flat[0].platform)
        self.lora = lora_settings(config.lora, config.model)
        self.frozen_base = FrozenBase(self.lora, config.model, config.train.compute_dtype) if self.lora else None
        abstract_model = nnx.eval_shape(lambda: self._fresh_model(0))
        self.graphdef, self._abstract_state = nnx.split(abstract_model)
        param_shapes = nnx.to_pure_dict(self._abstract_state)
        self.param_shardings = self._param_shardings()  # on the devices, where the step computes with them
        if self.frozen_base:
            param_shapes = jax.eval_shape(self.frozen_base.quantize, param_shapes)
            self.param_shardings = self.frozen_base.quantized_shardings(param_shapes, self.param_shardings, mesh)

        self.optimizer = make_optimizer(config, self.frozen_base)
        self.rest_shardings = self.optimizer.rest_shardings(self.param_shardings)  # between steps
        opt_shapes = jax.eval_shape(self.optimizer.init, self.saved(param_shapes))
        self.opt_shardings = self.optimizer.state_shardings(opt_shapes, self.saved(self.rest_shardings),
                                                            replicated(mesh))
        self.abstract_params = _with_shardings(param_shapes, self.rest_shardings)
        self.abstract_saved_params = self.saved(self.abstract_params)  # what a checkpoint holds
        self.abstract_opt_state = _with_shardings(opt_shapes, self.opt_shardings)
        # What the forward and backward passes hold on each device.
        compute_dtype = config.train.compute_dtype if self.optimizer.makes_compute_copy else None
        self.abstract_compute_params = jax.tree.map(
            lambda s, sharding: jax.ShapeDtypeStruct(s.shape, compute_dtype or s.dtype, sharding=sharding),
            param_shapes, self.param_shardings,
        )

        self.objective = objective_of(config)
        self.batch_sharding = batch_sharding(mesh)
        per_row = compute_sharding(mesh, DOCUMENTS)  # per-row arrays [B, N]: the rows split as the tokens are
        self.abstract_batch = {
            key: jax.ShapeDtypeStruct(shape, dtype,
                                      sharding=per_row if key in self.objective.per_row else self.batch_sharding)
            for key, (shape, dtype) in self.objective.batch_layout(config).items()
        }
        self.batch_shardings = {key: s.sharding for key, s in self.abstract_batch.items()}
        if self.lora:  # the base alone, the adapters off: the reference policy of DPO and GRPO
            base = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0), options=self.options,
                                                      param_dtype=config.train.compute_dtype))
            self._base_graphdef, self._abstract_base_state = nnx.split(base)
        self.step = jax.jit(
            self._step,
            in_shardings=(self.rest_shardings, self.opt_shardings, self.batch_shardings),
            out_shardings=(self.rest_shardings, self.opt_shardings, replicated(mesh)),  # every metric whole
            donate_argnums=(0, 1),
        )
        # Forward only: (params, batch) -> [B, S, 2] per-token cross-entropy and argmax hits (`jlong.eval`),
        # of the token arrays alone (the objective's own arrays left out).
        self.abstract_eval_batch = {key: s for key, s in self.abstract_batch.items() if key in TOKEN_ARRAYS}
        self.eval_step = jax.jit(self._token_scores, in_shardings=(self.rest_shardings, self.batch_sharding),
                                 out_shardings=self.batch_sharding)

    def _fresh_model(self, seed: int) -> Transformer:
        train = self.config.train
        # A LoRA run's frozen base has no float32 master copy: it is held in the compute dtype.
        base_dtype = train.compute_dtype if self.lora else train.param_dtype
        return Transformer(self.config.model, rngs=nnx.Rngs(seed), param_dtype=base_dtype, options=self.options,
                           lora=self.lora, adapter_dtype=train.param_dtype)

    def saved(self, params: dict) -> dict:
        """What of `params` (or of a tree shaped like them) a checkpoint holds and the
        optimizer updates: everything, or a LoRA run's adapters."""
        return self.frozen_base.trainable(params) if self.frozen_base else params

    def with_saved(self, params: dict, saved: dict) -> dict:
        """`params` with the part a checkpoint holds replaced by `saved`."""
        return self.frozen_base.join(self.frozen_base.frozen(params), saved) if self.frozen_base else saved

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

    def starting_params(self) -> dict:
        """The weights of step 1 when no checkpoint gives them: train.init_from's,
        model.hf_path's, or random from train.seed (a LoRA run's adapters fresh)."""
        hf_path, seed = self.config.model.hf_path, self.config.train.seed
        if initial := check_init_from(self.config):
            return self.load_initial_weights(initial)
        return self.load_hf_params(hf_path, seed) if hf_path else self.init_params(seed)

    def load_initial_weights(self, weights: InitialWeights) -> dict:
        """train.init_from's weights (`jlong.init_from`), read straight into the program's shardings."""
        if weights.kind == "hf":
            return self.load_hf_params(weights.path)
        checkpoints = Checkpoints(weights.path)
        try:
            checkpoints.check_layout(weights.step, {"params": self.abstract_params},
                                     f"{INIT_FROM} needs the weights of the configured model, in train.param_dtype")
            params, _ = checkpoints.restore(weights.step, self.abstract_params)
        finally:
            checkpoints.close()
        return params

    def init_params(self, seed: int) -> dict:
        """Random initial parameters, created directly in their shards (a QLoRA base quantized)."""
        def fresh():
            params = nnx.to_pure_dict(nnx.state(self._fresh_model(seed)))
            return self.frozen_base.quantize(params) if self.frozen_base else params

        return jax.jit(fresh, out_shardings=self.rest_shardings)()

    def load_hf_params(self, path: str, seed: int = 0) -> dict:
        """A Hugging Face checkpoint's weights, read shard by shard into their
        places; a LoRA run's base from them (quantized for QLoRA), its adapters
        fresh from `seed`."""
        from jlong.hf import load_hf_params

        if not self.frozen_base:
            on_devices = _with_shardings(self.abstract_params, self.param_shardings)
            params = load_hf_params(path, self.config.model, on_devices)
            return jax.device_put(params, self.rest_shardings, donate=True)
        model = nnx.eval_shape(lambda: Transformer(self.config.model, rngs=nnx.Rngs(0),
                                                   param_dtype=self.config.train.compute_dtype))
        base_shapes = nnx.to_pure_dict(nnx.state(model))
        base_shardings = self.frozen_base.frozen(self._param_shardings())
        base = load_hf_params(path, self.config.model, _with_shardings(base_shapes, base_shardings))
        quantize = jax.jit(self.frozen_base.quantize, out_shardings=self.frozen_base.frozen(self.rest_shardings),
                           donate_argnums=0)
        return self.frozen_base.join(quantize(base), self.saved(self.init_params_adapters(seed)))

    def init_params_adapters(self, seed: int) -> dict:
        """Fresh adapters (and nothing of the base: its random values are never made)."""
        def fresh():
            return self.saved(nnx.to_pure_dict(nnx.state(self._fresh_model(seed))))

        return jax.jit(fresh, out_shardings=self.saved(self.rest_shardings))()

    def place_saved(self, saved: dict) -> dict:
        """Host arrays of what a checkpoint holds (a LoRA run's adapters read
        from PEFT files) placed in their shards, in their dtypes."""
        def placed(x, target):
            x = np.asarray(x, target.dtype)
            return jax.make_array_from_callback(x.shape, target.sharding, functools.partial(_index, x))

        return jax.tree.map(placed, saved, self.abstract_saved_params)

    def init_opt_state(self, params: dict):
        return jax.jit(self.optimizer.init, out_shardings=self.opt_shardings)(self.saved(params))

    def bind(self, params: dict) -> Transformer:
        state = jax.tree.map(lambda v: v, self._abstract_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    # -- the step

    def loss(self, params: dict, batch: dict):
        """The run's training loss (its objective's) of a batch placed by `place_batch`."""
        return self._loss_and_metrics(params, batch)[0]

    def _loss_and_metrics(self, params: dict, batch: dict):
        return self.objective.loss_and_metrics(self, params, batch)

    def base_model(self, params: dict) -> Transformer:
        """A LoRA run's frozen base alone, the adapters off, from `params` (the reference policy of DPO and GRPO)."""
        state = jax.tree.map(lambda v: v, self._abstract_base_state)
        nnx.replace_by_pure_dict(state, self.frozen_base.frozen(params))
        return nnx.merge(self._base_graphdef, state)

    def _step(self, params, opt_state, batch):
        """One optimizer step: the metrics are the loss, the gradient's norm and the model's own
        (`Transformer.loss_and_metrics`)."""
        if self.frozen_base:  # only the adapters are differentiated: the base gets no gradient at all
            base, adapters = self.frozen_base.frozen(params), self.frozen_base.trainable(params)
            loss_of = lambda a: self._loss_and_metrics(self.frozen_base.join(base, a), batch)  # noqa: E731
            (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(adapters)
            adapters, opt_state, grad_norm = self.optimizer.update(grads, opt_state, adapters)
            return self.frozen_base.join(base, adapters), opt_state, {"loss": loss, "grad_norm": grad_norm, **metrics}
        compute_params = self.optimizer.compute_params(params, self.param_shardings)
        (loss, metrics), grads = jax.value_and_grad(self._loss_and_metrics, has_aux=True)(compute_params, batch)
        params, opt_state, grad_norm = self.optimizer.update(grads, opt_state, params)
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm, **metrics}

    def _token_scores(self, params, batch):
        return self.bind(self.optimizer.compute_params(params, self.param_shardings)).token_scores(batch)

    def lower_eval(self) -> jax.stages.Lowered:
        """The forward-only program of `eval_step`, lowered for abstract parameters and batch."""
        return self.eval_step.lower(self.abstract_params, self.abstract_eval_batch)

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
            laid_out = value if key in self.objective.per_row else layout.lay_out(value)
            placed[key] = jax.make_array_from_callback(
                value.shape, self.batch_shardings.get(key, self.batch_sharding),
                functools.partial(_index, laid_out))
        return placed


def _index(array: np.ndarray, index):
    return array[index]
