"""Small random Hugging Face models (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)."""

import torch
import transformers

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so the test sequences use the scaling
}

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-scaled": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_scaling": LLAMA3_SCALING}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"tie_word_embeddings": True, "head_dim": 24}),
}


def small_hf_model(name: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = ARCHITECTURES[name]
    fields = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    fields.update(extra, **overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**fields)).eval()
    with torch.no_grad():  # norms start at one and biases at zero: make them matter
        for name_, param in model.named_parameters():
            if "norm" in name_ or "bias" in name_:
                param.add_(0.2 * torch.randn_like(param))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()
