"""jlong: long-context training of Llama- and Qwen-style transformers in JAX."""

from jlong.config import Config, ModelConfig, load_config
from jlong.errors import JlongError
from jlong.hf import from_hf, to_hf
from jlong.model.transformer import ForwardOptions, Transformer

__all__ = [
    "Config", "ModelConfig", "load_config", "JlongError",
    "from_hf", "to_hf", "ForwardOptions", "Transformer",
]
__version__ = "0.1.0"
