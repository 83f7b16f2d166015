"""Linear-attention token mixers: layers whose memory of the past is a
recurrent state per head rather than the keys and values themselves.

- `gated_delta`: the gated delta rule (a state update per token) as kernels:
  the chunked form the model trains with and a token-by-token reference;
- `gated_deltanet`: Gated DeltaNet (Qwen3.5's linear-attention layer): the
  projections, the short causal convolution, the rule and the gated norm,
  run per device by a sequence-parallel method.
"""
