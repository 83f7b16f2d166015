"""What a layer reads and writes besides the residual stream: the seam a
sampler's caches pass through (`jlong.generation`).

The model's layer loop hands each layer its slice of `LayerIO.inputs`
(arrays stacked over the layers of one type, as the parameters are) by way
of the sequence-parallel method the layer runs with: `method_for` binds the
layer's slice to a method (the prefill's, which runs the training
attention and keeps what a cache needs; the decode's, which attends one
query to the cache). The family's block calls that method as it calls any
other, knowing nothing of caches; afterwards the method's `written` holds
what the layer wrote, and the loop returns it stacked over the layers of
each type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jlong.attention.methods import SequenceParallelMethod


class LayerBound(Protocol):
    written: Any  # what the layer wrote (a dict of arrays), set while its block runs


class LayerIO(Protocol):
    # name -> (the layer type whose layers it is stacked over, or None for every layer; the stacked array)
    inputs: dict[str, tuple[str | None, Any]]

    def method_for(self, options, inputs: dict[str, Any]) -> SequenceParallelMethod | LayerBound:
        """The sequence-parallel method one layer runs with, bound to its `inputs`; `options` are the layer's
        `ForwardOptions` (its type, its attention window)."""
