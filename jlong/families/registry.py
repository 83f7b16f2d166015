"""The model families jlong knows, by name: the built-in ones and any a
script or test registers."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jlong.config.registry import FAMILIES
from jlong.families.base import Family
from jlong.families.deepseek import DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE_LITE
from jlong.families.gemma3 import GEMMA3_TEXT
from jlong.families.gpt_oss import GPT_OSS
from jlong.families.llama import LLAMA, QWEN2, QWEN3
from jlong.families.qwen3_5 import QWEN3_5_TEXT
from jlong.families.qwen3_5_moe import QWEN3_5_MOE_TEXT
from jlong.families.qwen3_moe import QWEN3_MOE

if TYPE_CHECKING:
    from jlong.config import ModelConfig


def register(family: Family) -> Family:
    """Makes `family` known as `model.family=<family.name>`, to the config too
    (`jlong.config.registry`), replacing one of the same name, so a notebook
    can register an edited family again."""
    return FAMILIES.add(family.name, family)


for _family in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GEMMA3_TEXT, QWEN3_5_TEXT, QWEN3_5_MOE_TEXT, GPT_OSS, DEEPSEEK_V2,
                DEEPSEEK_V3, GLM4_MOE_LITE):
    register(_family)


def names() -> list[str]:
    return FAMILIES.names()


def family_named(name: str, where: str = "model.family") -> Family:
    return FAMILIES.named(name, where)


def family_of(model: ModelConfig) -> Family:
    return family_named(model.family)
