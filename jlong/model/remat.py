"""Activation checkpointing of the decoder layers: `memory.remat`.

The policy wraps the body of the layer scan, so it is applied in one place
and composes with the checkpointed UPipe stages inside attention:

- `none`: nothing is recomputed; every layer's intermediates live until the
  backward pass reaches it.
- `full`: a layer keeps nothing of its own; the backward pass recomputes the
  whole layer from its input.
- `save_inputs`: each layer keeps only its input (named `LAYER_INPUT`), one
  [B, S/C, D] array per layer in the compute dtype.
- `offload_inputs`: as `save_inputs`, but the inputs go to pinned host memory
  in the forward pass and come back for the backward pass. On CPU the copy
  compiles to nothing; the host bytes are counted from the shapes instead.
- `save_attention`: keeps each layer's input and its attention kernel's
  outputs (output and log-sum-exp), so the recomputed forward pass skips the
  attention kernel, the costliest part at long context.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from jlong.attention.ulysses import KEEP_ATTENTION_OUTPUT

LAYER_INPUT = "layer_input"

_policies = jax.checkpoint_policies
POLICIES = {
    "full": _policies.nothing_saveable,
    "save_inputs": _policies.save_only_these_names(LAYER_INPUT),
    "offload_inputs": _policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "save_attention": _policies.save_from_both_policies(
        _policies.save_only_these_names(LAYER_INPUT), KEEP_ATTENTION_OUTPUT
    ),
}
REMAT_CHOICES = ("none", *POLICIES)


def name_layer_input(x):
    """Marks a layer's input as the value the input-saving policies keep."""
    return checkpoint_name(x, LAYER_INPUT)


def checkpoint_layer(layer_fn, remat: str):
    """`layer_fn` under the `memory.remat` policy (itself for `none`)."""
    if remat == "none":
        return layer_fn
    # prevent_cse=False: inside a scan, CSE cannot merge the recomputation
    # with the forward pass, and the barriers it would add cost speed.
    return jax.checkpoint(layer_fn, policy=POLICIES[remat], prevent_cse=False)


def offloads_layer_inputs(remat: str) -> bool:
    return remat == "offload_inputs"
