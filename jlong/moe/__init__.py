"""Mixture-of-experts channel mixers: each token runs through the few
experts a router picks for it rather than through one wide MLP.

- `routing`: the softmax router's top-k choice per token, the order that
  groups (token, expert) pairs by expert, and the statistics of a layer's
  routing (load per expert, the load-balancing loss);
- `group_routing`: DeepSeek's routing (sigmoid or softmax scores, a
  correction bias for choosing, group-limited top-k, scaled weights);
- `grouped_matmul`: the kernels that multiply each expert's group of rows by
  that expert's matrix (`KERNELS`);
- `experts`: the routed SwiGLU experts (and a shared expert, gated or not), run on
  one device's tokens a sequence tile at a time;
- `mxfp4`: experts' matrices stored in MXFP4 (GPT-OSS's published
  checkpoints), read back to floats.
"""
