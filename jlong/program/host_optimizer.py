"""`memory.optimizer_offload`: AdamW whose float32 master parameters and
moments live in pinned host memory, streamed through the devices layer by layer.

Between steps the devices hold nothing of the model: the master parameters
and Adam's moments sit in host memory, sharded as the parameters are (each
device's share in its own host's memory). A step

1. streams the master parameters to the devices one layer at a time, each cast
   to the compute dtype: the forward and backward passes use these copies;
2. differentiates with respect to the copies, so gradients are in the compute
   dtype (as DeepSpeed's ZeRO offload keeps them);
3. streams each layer's master parameters and moments in, updates them with
   that layer's gradient, clipped by the global norm (AdamW, float32), and
   sends them back to host memory.

A device holds the compute-dtype parameters and gradients and one layer's
float32 update at a time. With a float32 compute dtype the update is the
on-device optimizer's, number for number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jlong.config import TrainConfig
from jlong.program.optimizer import DecayMask, adamw, state_shardings

LAYERS = "layers"  # the parameter dict's entry of stacked [num_layers, ...] arrays
HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def in_memory(shardings, kind: str):
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def lives_on_host(leaf) -> bool:
    """Which leaves of the parameters and state live in host memory: the
    floating-point ones. The integer step counters stay on the devices (a few
    bytes, and XLA:GPU refuses to schedule copies of integer host buffers)."""
    return jnp.issubdtype(leaf.dtype, jnp.floating)


def _to(space, tree):
    return jax.tree.map(lambda x: jax.device_put(x, space) if lives_on_host(x) else x, tree)


def _split(tree: dict) -> tuple[dict, dict]:
    return tree[LAYERS], {key: value for key, value in tree.items() if key != LAYERS}


def _stacks(layers: dict) -> dict[str, dict]:
    """The layer parameters in groups stacked over the same layers, each run
    through its own loop: one group (every layer) in most families; a hybrid's
    parameters of one layer type are stacked over its layers alone. Keyed
    by stack length, longest first; "" for a single group."""
    groups: dict[int, dict] = {}
    for name, w in layers.items():
        groups.setdefault(w.shape[0], {})[name] = w
    if len(groups) == 1:
        return {"": layers}
    return {f"stack_{n}": groups[n] for n in sorted(groups, reverse=True)}


def _layer_states(state_layers, stacks: dict[str, dict]) -> dict:
    """AdamW's layer state by stack (`_stacks`), from the stored form: the state
    itself for a single group (as before hybrids), else keyed like the stacks."""
    return {"": state_layers} if list(stacks) == [""] else state_layers


def _stored(by_stack: dict):
    return by_stack[""] if list(by_stack) == [""] else by_stack


def _joined(by_stack: dict[str, dict]) -> dict:
    return {name: w for group in by_stack.values() for name, w in group.items()}


class HostAdamW:
    """The offloaded optimizer (`jlong.program.optimizer.Optimizer`), for a
    parameter dict whose `layers` entry holds stacked per-layer arrays. Its
    state is {"layers": AdamW's state stacked per layer, "rest": AdamW's
    state of the other parameters}."""

    makes_compute_copy = True

    def __init__(self, train: TrainConfig, decays: DecayMask):
        self.train, self.adamw = train, adamw(train, decays)

    def rest_shardings(self, device_shardings: dict) -> dict:
        """Between steps the master parameters live in host memory."""
        return in_memory(device_shardings, "pinned_host")

    def in_host_memory(self, leaf) -> bool:
        return lives_on_host(leaf)

    def init(self, master: dict) -> dict:
        layers, rest = _split(master)
        stacks = _stacks(layers)
        self.stack_names = {key: tuple(group) for key, group in stacks.items()}  # for `state_shardings`
        by_stack = {key: jax.vmap(self.adamw.init)(group) for key, group in stacks.items()}
        return {LAYERS: _stored(by_stack), "rest": self.adamw.init(rest)}

    def state_shardings(self, state_shapes: dict, rest_shardings: dict, counters) -> dict:
        """Moments placed like their parameters (in host memory), counters on the devices."""
        layers, rest = _split(rest_shardings)
        stacks = {key: {name: layers[name] for name in group} for key, group in self.stack_names.items()}
        shapes = _layer_states(state_shapes[LAYERS], stacks)
        by_stack = {key: state_shardings(self.adamw, shapes[key], group, counters) for key, group in stacks.items()}
        return {LAYERS: _stored(by_stack), "rest": state_shardings(self.adamw, state_shapes["rest"], rest, counters)}

    def compute_params(self, master: dict, device_shardings: dict) -> dict:
        """The master parameters on the devices in the compute dtype, one layer at a time."""
        dtype = self.train.compute_dtype
        layers, rest = _split(master)

        def one_layer(_, layer):
            return None, jax.tree.map(lambda w: jax.device_put(w, DEVICE).astype(dtype), layer)

        layers = _joined({key: jax.lax.scan(one_layer, None, group)[1] for key, group in _stacks(layers).items()})
        copy = {LAYERS: layers, **jax.tree.map(lambda w: jax.device_put(w, DEVICE).astype(dtype), rest)}
        return jax.lax.with_sharding_constraint(copy, device_shardings)

    def update(self, grads: dict, state: dict, master: dict) -> tuple[dict, dict, jax.Array]:
        """(new master parameters, new state), both in host memory, and the
        gradients' global norm (in float32), by which they are clipped."""
        grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))

        def step(grads, state, master):
            grads = jax.tree.map(lambda g: self._clipped(g, grad_norm).astype(jnp.float32), grads)
            state, master = _to(DEVICE, (state, master))
            updates, state = self.adamw.update(grads, state, master)
            return _to(HOST, (optax.apply_updates(master, updates), state))

        def one_layer(_, layer):
            return None, step(*layer)

        grads_layers, grads_rest = _split(grads)
        master_layers, master_rest = _split(master)
        # The loop's stacked outputs are fresh host buffers that XLA then moves
        # into the donated ones: host memory holds a second copy of the layers'
        # states at the end of the step (an in-place update inside the loop
        # does not compile on XLA:GPU today). The plan counts it.
        stacks = _stacks(master_layers)
        grads_by_stack, states = _stacks(grads_layers), _layer_states(state[LAYERS], stacks)
        new_master, new_states = {}, {}
        for key, group in stacks.items():
            _, (new_master[key], new_states[key]) = jax.lax.scan(
                one_layer, None, (grads_by_stack[key], states[key], group))
        master_rest, state_rest = step(grads_rest, state["rest"], master_rest)
        return {LAYERS: _joined(new_master), **master_rest}, {LAYERS: _stored(new_states), "rest": state_rest}, grad_norm

    def _clipped(self, g, grad_norm):
        """optax's global-norm clipping, one gradient at a time."""
        limit = self.train.grad_clip
        if not limit > 0:
            return g
        return jnp.where(grad_norm < limit, g, (g / grad_norm.astype(g.dtype)) * limit)
