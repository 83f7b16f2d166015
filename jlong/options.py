"""The named choices shared by the configuration and the model, without jax:
config.py validates against them, the model's code is typed by them."""

from __future__ import annotations

import typing
from typing import Literal

DType = Literal["float32", "bfloat16", "float16"]
RematName = Literal["none", "full", "save_inputs", "offload_inputs", "save_attention", "offload_attention",
                    "offload_inputs_save_attention"]

REMAT_NAMES: tuple[str, ...] = typing.get_args(RematName)

DEFAULT_BLOCK_SIZE = 512  # attention.block_size: the blockwise kernel's query and key blocks
DEFAULT_MAX_DOCUMENTS = 64  # attention.max_documents: the packed documents per sequence cuDNN takes


class RematSegment(typing.NamedTuple):
    """Consecutive decoder layers under one `memory.remat` policy."""

    remat: RematName
    layers: int
    layers_per_checkpoint: int = 1
