"""What attention and the model share, below both: the maths (RMSNorm, RoPE,
SwiGLU, sequence tiles with their gradients) and what they know of how a
sequence is split over devices (`Shards`, the ring's zigzag order). Nothing
here imports attention, the model or the mesh placement."""
