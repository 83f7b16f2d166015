"""Sequence-parallel methods: how attention runs over a sequence sharded
across devices, one module each behind one interface (`base`):

- `ulysses`: heads exchanged all-to-all over sp, in UPipe head stages, with
  ring attention across sp groups (`mesh.ring`);
- `allgather`: keys and values gathered over sp, each device attending its
  own queries (the Llama 3 paper's context parallelism), in head stages.

`attention.sp_method` names one; a new method registers itself here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from jlong.attention.methods.allgather import ALLGATHER
from jlong.attention.methods.base import SequenceParallelMethod
from jlong.attention.methods.ulysses import ULYSSES
from jlong.config.registry import SP_METHODS

if TYPE_CHECKING:
    from jlong.config import Config

for _method in (ULYSSES, ALLGATHER):
    SP_METHODS.add(_method.name, _method)

def register(method: SequenceParallelMethod) -> SequenceParallelMethod:
    """Makes `method` known as attention.sp_method=<method.name>, to the config too (`jlong.config.registry`)."""
    return SP_METHODS.add(method.name, method)


def method_named(name: str) -> SequenceParallelMethod:
    return SP_METHODS.named(name)


def method_of(config: Config) -> SequenceParallelMethod:
    return method_named(config.attention.sp_method)


__all__ = ["SequenceParallelMethod", "method_named", "method_of", "register"]
