"""Activation checkpointing of the decoder layers: `memory.remat`.

The policy wraps the body of the layer scan, so it is applied in one place
and composes with the checkpointed UPipe stages inside attention:

- `none`: nothing is recomputed; every layer's intermediates live until the
  backward pass reaches it.
- `full`: a layer keeps nothing of its own; the backward pass recomputes the
  whole layer from its input.
- `save_inputs`: each layer keeps only its input (named `LAYER_INPUT`), one
  [B, S/(R*C), D] shard per layer and device (R the ring, C the sp degree),
  in the compute dtype.
- `offload_inputs`: as `save_inputs`, but the inputs go to pinned host memory
  in the forward pass and come back for the backward pass. On CPU the copy
  compiles to nothing; the host bytes are counted from the shapes instead.
- `save_attention`: keeps each layer's input and its attention kernel's
  outputs (output and log-sum-exp), so the recomputed forward pass skips the
  attention kernel, the costliest part at long context.
- `offload_attention`: as `save_attention`, with the input, the attention
  output and the log-sum-exp in pinned host memory: about twice the host
  bytes of `offload_inputs` for one attention forward pass less per layer.
- `offload_inputs_save_attention`: the input in host memory (as
  `offload_inputs`) and the attention output and log-sum-exp on the device
  (as `save_attention`): the attention forward pass is skipped for the
  device bytes of one attention output per layer, no more host bytes than
  `offload_inputs`.

`memory.layers_per_checkpoint` = k > 1 (with `save_inputs` or
`offload_inputs`) applies the policy to groups of k layers: one input is kept
per group, k times fewer bytes, and the backward pass first recomputes the
group's layers to get the other k - 1 inputs back (held on the device while
that group's backward runs), then each layer as with k = 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from jax.ad_checkpoint import Offloadable, Recompute, checkpoint_name

from jlong.attention.ring import ATTENTION_LSE, ATTENTION_OUT
from jlong.attention.methods.base import KEEP_ATTENTION_OUTPUT
from jlong.options import REMAT_NAMES, RematName

LAYER_INPUT = "layer_input"

_policies = jax.checkpoint_policies
_TO_HOST = Offloadable(src="device", dst="pinned_host")


def _offload_inputs_and_attention(primitive, *_, **params):
    """Layer inputs and the attention's output and log-sum-exp go to host memory; the rest is recomputed."""
    named = primitive.name == "name" and params.get("name") in (LAYER_INPUT, ATTENTION_OUT, ATTENTION_LSE)
    return _TO_HOST if named else Recompute



@dataclasses.dataclass(frozen=True)
class RematPolicy:
    name: RematName
    jax_policy: Callable | None  # None: the layer is not checkpointed at all
    keeps_layer_inputs: bool = False  # one [B, S/(R*C), D] input per layer lives until the backward pass
    offloads_layer_inputs: bool = False  # ... in host memory rather than on the device
    offloads_attention: bool = False  # the attention output and log-sum-exp too

    def wrap(self, layer_fn):
        """`layer_fn` under this policy."""
        if self.jax_policy is None:
            return layer_fn
        # prevent_cse=False: inside a scan, CSE cannot merge the recomputation
        # with the forward pass, and the barriers it would add cost speed.
        return jax.checkpoint(layer_fn, policy=self.jax_policy, prevent_cse=False)


REMAT_POLICIES: dict[str, RematPolicy] = {
    policy.name: policy
    for policy in (
        RematPolicy("none", None),
        RematPolicy("full", _policies.nothing_saveable),
        RematPolicy("save_inputs", _policies.save_only_these_names(LAYER_INPUT), keeps_layer_inputs=True),
        RematPolicy(
            "offload_inputs",
            _policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=[LAYER_INPUT],
                offload_src="device",
                offload_dst="pinned_host",
            ),
            keeps_layer_inputs=True,
            offloads_layer_inputs=True,
        ),
        RematPolicy(
            "save_attention",
            _policies.save_from_both_policies(_policies.save_only_these_names(LAYER_INPUT), KEEP_ATTENTION_OUTPUT),
            keeps_layer_inputs=True,
        ),
        RematPolicy(
            "offload_attention", _offload_inputs_and_attention,
            keeps_layer_inputs=True, offloads_layer_inputs=True, offloads_attention=True,
        ),
        RematPolicy(
            "offload_inputs_save_attention",
            _policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[ATTENTION_OUT, ATTENTION_LSE],
                names_which_can_be_offloaded=[LAYER_INPUT],
                offload_src="device",
                offload_dst="pinned_host",
            ),
            keeps_layer_inputs=True,
            offloads_layer_inputs=True,
        ),
    )
}
assert tuple(REMAT_POLICIES) == REMAT_NAMES, "every memory.remat choice has exactly one policy"


def remat_policy(name: RematName) -> RematPolicy:
    return REMAT_POLICIES[name]


def name_layer_input(x):
    """Marks a layer's input as the value the input-saving policies keep."""
    return checkpoint_name(x, LAYER_INPUT)


def scan_layers(layer_fn, x, stacked_params: dict, policy: RematPolicy, layers_per_checkpoint: int = 1):
    """x through every layer: `layer_fn(x, params) -> (x, out)` scanned over
    the leading (layers) axis of `stacked_params`, under `policy`, with one
    kept input per `layers_per_checkpoint` layers. Returns (x, each layer's
    `out` stacked on a leading layers axis)."""
    k = layers_per_checkpoint
    if k == 1:
        body = policy.wrap(lambda x, params: layer_fn(name_layer_input(x), params))
        return jax.lax.scan(body, x, stacked_params)
    each_layer = REMAT_POLICIES["full"].wrap(layer_fn)

    def group(x, group_params):
        return jax.lax.scan(each_layer, name_layer_input(x), group_params)

    grouped = jax.tree.map(lambda w: w.reshape(w.shape[0] // k, k, *w.shape[1:]), stacked_params)
    x, outs = jax.lax.scan(policy.wrap(group), x, grouped)
    return x, jax.tree.map(lambda o: o.reshape(o.shape[0] * k, *o.shape[2:]), outs)


def scan_periods(layer_fns, x, stacked_params: dict, policies: list[RematPolicy], slots: list[dict[str, int]],
                 layers_per_checkpoint: int = 1):
    """x through layers that repeat with a period: one scan over the leading
    (repeats) axis of `stacked_params` ([repeats, per period, ...]) whose
    body runs the period's layers in turn, layer i as `layer_fns[i](x, params)
    -> (x, out)` with the parameters `slots[i]` names (name -> index in the
    period's stack). Each layer is checkpointed on its own under
    `policies[i]`, so the policies keep what they keep in a loop of single
    layers; with `layers_per_checkpoint` = k > 1 (k dividing the period),
    each k consecutive layers are one checkpoint under the first one's
    policy, as `scan_layers` groups them. Returns (x, for each layer of the
    period, its `out` stacked over the repeats)."""
    k = layers_per_checkpoint

    def run(i, x, params):
        def entry(name, index):  # leaf by leaf: a 4-bit weight is codes and scales
            return jax.tree.map(lambda a: a[index], params[name])

        return layer_fns[i](x, {name: entry(name, index) for name, index in slots[i].items()})

    def period(x, params):
        outs = []
        for first in range(0, len(layer_fns), k):
            def group(x, params, first=first):
                x = name_layer_input(x)
                if k == 1:
                    x, out = run(first, x, params)
                    return x, [out]
                group_outs = []
                for i in range(first, first + k):
                    x, out = REMAT_POLICIES["full"].wrap(lambda x, p, i=i: run(i, x, p))(x, params)
                    group_outs.append(out)
                return x, group_outs

            x, group_outs = policies[first].wrap(group)(x, params)
            outs += group_outs
        return x, outs

    return jax.lax.scan(period, x, stacked_params)
