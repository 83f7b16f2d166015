"""Small random Hugging Face models (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM,
Qwen3_5ForCausalLM, Qwen3MoeForCausalLM, Qwen3_5MoeForCausalLM, GptOssForCausalLM, DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM, Glm4MoeLiteForCausalLM)."""

import torch
import transformers

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so the test sequences use the scaling
}

# YaRN as Qwen's long-context checkpoints ship it (factor and original context
# only: the attention factor follows from the factor), and with every knob set.
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
YARN_TUNED = {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.9, "mscale_all_dim": 0.5}
LINEAR = {"rope_type": "linear", "factor": 2.0}
QWEN3 = {"tie_word_embeddings": True, "head_dim": 24}
# Gemma 3 with windows shorter than the test sequences (70 tokens), a global layer between sliding ones,
# linear-scaled global RoPE and a query scale other than head_dim^-1/2.
GEMMA3 = {
    "num_hidden_layers": 3, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
}

# Qwen3.5 with both layer types (a gated full-attention layer between Gated DeltaNet ones), twice as many value
# heads as key heads, value heads wider than key heads, and RoPE on a quarter of each head's dimensions.
QWEN3_5 = {
    "num_hidden_layers": 4, "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}

# Mixtures of experts: Qwen3-MoE with a dense layer between sparse ones, its top-k probabilities renormalised or
# not; Qwen3.5-MoE (always renormalised, a gated shared expert) on the hybrid layers above.
QWEN3_MOE = {"num_hidden_layers": 3, "head_dim": 16, "moe_intermediate_size": 24, "num_experts": 8,
             "num_experts_per_tok": 2, "mlp_only_layers": [1], "norm_topk_prob": True}
QWEN3_5_MOE = {**QWEN3_5, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 40, "num_experts": 8,
               "num_experts_per_tok": 2}
# GPT-OSS with an 8-token window (shorter than the test sequences) before a full-attention layer, YaRN over an
# original 16 tokens, a SwiGLU limit that clamps many of the experts' gate and up values (|x| ~ 0.25), and (by
# perturbed_norms) sinks far from zero and nonzero router and expert biases.
GPT_OSS = {"head_dim": 16, "intermediate_size": 32, "max_position_embeddings": 512, "num_local_experts": 8,
           "num_experts_per_tok": 2, "sliding_window": 8, "swiglu_limit": 0.2,
           "layer_types": ["sliding_attention", "full_attention"],
           "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 150000.0}}

# Multi-head latent attention with DeepSeek's mixtures: a dense first layer, values narrower than the queries and
# keys (DeepSeek-V3: compressed queries; V2: direct ones) or wider (GLM), YaRN with a softmax-scale correction
# (mscale_all_dim) unlike its attention factor's, an RMSNorm epsilon far from the latents' own 1e-6, group-limited
# routing (V3: 2 of 4 groups by their two best biased sigmoid scores; V2: 1 by its best softmax score), scaled
# weights, and (by perturbed_norms) correction biases that change which experts are chosen.
LATENT_ATTENTION = {"num_hidden_layers": 3, "num_key_value_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 12,
                    "qk_rope_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                    "n_shared_experts": 2, "rms_norm_eps": 1e-2,
                    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                        "mscale": 0.9, "mscale_all_dim": 0.5, "rope_theta": 10000.0}}
DEEPSEEK_V3 = {**LATENT_ATTENTION, "q_lora_rank": 24, "v_head_dim": 10, "first_k_dense_replace": 1, "n_group": 4,
               "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
DEEPSEEK_V2 = {**LATENT_ATTENTION, "q_lora_rank": None, "v_head_dim": 10, "first_k_dense_replace": 1, "n_group": 4,
               "topk_group": 1, "topk_method": "group_limited_greedy", "routed_scaling_factor": 1.5}
GLM4_MOE_LITE = {**LATENT_ATTENTION, "q_lora_rank": 24, "v_head_dim": 24, "routed_scaling_factor": 1.8,
                 "norm_topk_prob": True, "mlp_layer_types": ["sparse", "dense", "sparse"]}

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-scaled": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_scaling": LLAMA3_SCALING}),
    "llama-yarn": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_scaling": YARN_TUNED}),
    "llama-linear": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {"rope_scaling": LINEAR}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen2-yarn": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"rope_scaling": YARN}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3),
    "qwen3-yarn": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {**QWEN3, "rope_scaling": YARN}),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, GEMMA3),
    "qwen3.5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, QWEN3_5),
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, QWEN3_MOE),
    "qwen3-moe-unnormed": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                           {**QWEN3_MOE, "norm_topk_prob": False}),
    "qwen3.5-moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, QWEN3_5_MOE),
    "gpt-oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, GPT_OSS),
    "deepseek-v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, DEEPSEEK_V3),
    "deepseek-v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, DEEPSEEK_V2),
    "glm4-moe-lite": (transformers.Glm4MoeLiteConfig, transformers.Glm4MoeLiteForCausalLM, GLM4_MOE_LITE),
}
MIXTURES = ("qwen3-moe", "qwen3-moe-unnormed", "qwen3.5-moe")
SCALED = ("llama3-scaled", "llama-yarn", "llama-linear", "qwen2-yarn", "qwen3-yarn")


def small_hf_model(name: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = ARCHITECTURES[name]
    fields = dict(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    fields.update(extra, **overrides)
    if "rope_parameters" in fields:
        fields.pop("rope_theta")
    torch.manual_seed(seed)
    return perturbed_norms(model_cls(config_cls(**fields)).eval())


def perturbed_norms(model):
    """`model` with its norms and biases moved off their starting values (one and zero), so they matter, any
    router's weights scaled up so that no token's top-k is a near tie that rounding could decide (a sigmoid
    router's less: its scores would saturate at one), DeepSeek-V3's correction biases (buffers) as far from zero
    as its scores' spread, latent attention's projections scaled up so that its scores are far from uniform (and
    their rotary layout and softmax scale matter), and attention sinks (GPT-OSS) far from zero, normal with std 2."""
    with torch.no_grad():
        latent = any(name.endswith("kv_a_proj_with_mqa.weight") for name, _ in model.named_parameters())
        sigmoid_router = False
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn_like(buffer))
                sigmoid_router = True
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(0.2 * torch.randn_like(param))
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                param.mul_(5.0 if sigmoid_router else 50.0)
            if latent and name.endswith(("q_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                                         "kv_b_proj.weight")):
                param.mul_(4.0)
            if name.endswith("self_attn.sinks"):
                param.copy_(2.0 * torch.randn_like(param))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()
