"""Model families: one module per architecture (`llama`: Llama 3.x, Qwen 2.5,
Qwen 3; `gemma3`: Gemma 3's text model), each a `Family` (`base`) built from shared pieces (`blocks`,
`params`), found by name in the registry (`registry`)."""

from jlong.families.base import Family, HFTensor
from jlong.families.params import ParamSpec, Role
from jlong.families.registry import family_named, family_of, names, register

__all__ = ["Family", "HFTensor", "ParamSpec", "Role", "family_named", "family_of", "names", "register"]
