"""The optimizer: AdamW with global-norm clipping and a warmup + cosine
learning-rate schedule, behind one interface (`Optimizer`) with two
implementations, chosen once by `jlong.program.train_program.make_optimizer`:

- `DeviceAdamW`: optax on the devices; parameters and moments sharded over
  them (ZeRO-3);
- `jlong.program.host_optimizer.HostAdamW` (`memory.optimizer_offload`): float32
  master parameters and moments in pinned host memory, streamed through the
  devices layer by layer.

The train step (`jlong.program.train_program`) and the planner only talk to the interface.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import optax

from jlong.config import TrainConfig

# params -> the same tree of booleans: which parameters weight decay applies to.
DecayMask = Callable[[dict], dict]


class Optimizer(Protocol):
    """Where the parameters and optimizer state live, and one update."""

    # The step differentiates a compute-dtype copy it makes of the parameters
    # (on the devices), rather than the parameters themselves.
    makes_compute_copy: bool

    def rest_shardings(self, device_shardings: dict) -> dict:
        """The parameters' shardings between steps, from their shardings on the devices."""

    def init(self, params: dict):
        """The state for `params`."""

    def state_shardings(self, state_shapes, rest_shardings: dict, counters) -> object:
        """The state's shardings: moments placed like their parameters, step counters in `counters`."""

    def compute_params(self, params: dict, device_shardings: dict) -> dict:
        """Inside the step: the parameters the forward and backward passes use."""

    def update(self, grads: dict, state, params: dict) -> tuple[dict, object, jax.Array]:
        """Inside the step: (new parameters, new state, the gradients' global norm)."""

    def in_host_memory(self, leaf) -> bool:
        """Whether a leaf of the parameters or state lives in host memory between steps."""


def learning_rate(train: TrainConfig, step):
    """The learning rate of 1-based step `step`: linear warmup to lr over
    warmup_steps (step 1 already moves), then cosine decay to
    min_lr_ratio x lr at the last step."""
    peak, floor = train.lr, train.lr * train.min_lr_ratio
    step = jnp.asarray(step, jnp.float32)
    warm = peak * step / max(train.warmup_steps, 1)
    progress = jnp.clip((step - train.warmup_steps) / max(train.steps - train.warmup_steps, 1), 0.0, 1.0)
    cosine = floor + (peak - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return jnp.where(step <= train.warmup_steps, warm, cosine)


def learning_rate_schedule(train: TrainConfig) -> optax.Schedule:
    """optax counts updates from 0; update number c is step c + 1."""
    return lambda count: learning_rate(train, count + 1)


def clipping(train: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping (stateless); identity when train.grad_clip is 0."""
    return optax.clip_by_global_norm(train.grad_clip) if train.grad_clip > 0 else optax.identity()


def adamw(train: TrainConfig, decays: DecayMask) -> optax.GradientTransformation:
    """AdamW with the schedule, decaying the parameters `decays` marks (the
    model's weight matrices, by their role: `jlong.families.Family.decay_mask`);
    elementwise, so it may update parameters piece by piece."""
    return optax.adamw(
        learning_rate_schedule(train),
        b1=train.b1,
        b2=train.b2,
        eps=train.eps,
        weight_decay=train.weight_decay,
        mask=decays,
    )


def state_shardings(optimizer: optax.GradientTransformation, state_shapes, param_shardings, counters_sharding):
    """Shardings of `optimizer`'s state: the moments placed like their
    parameters, everything else (step counters) in `counters_sharding`."""
    return optax.tree_utils.tree_map_params(
        optimizer, lambda _, sharding: sharding, state_shapes, param_shardings,
        transform_non_params=lambda _: counters_sharding,
    )


class DeviceAdamW:
    """optax's clipping and AdamW on the devices: the parameters the step
    differentiates are the parameters themselves."""

    makes_compute_copy = False

    def __init__(self, train: TrainConfig, decays: DecayMask):
        self.optax = optax.chain(clipping(train), adamw(train, decays))

    def rest_shardings(self, device_shardings):
        return device_shardings

    def init(self, params):
        return self.optax.init(params)

    def state_shardings(self, state_shapes, rest_shardings, counters):
        return state_shardings(self.optax, state_shapes, rest_shardings, counters)

    def compute_params(self, params, device_shardings):
        return params

    def update(self, grads, state, params):
        grad_norm = optax.tree.norm(grads)
        updates, state = self.optax.update(grads, state, params)
        return optax.apply_updates(params, updates), state, grad_norm

    def in_host_memory(self, leaf) -> bool:
        return False
