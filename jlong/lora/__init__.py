"""LoRA and QLoRA: a frozen base (in the compute dtype, or in 4-bit NF4)
with trainable low-rank adapters on the linear layers a run names.

- `targets`: which matrices a run adapts (PEFT's module names) and the
  adapters' parameters;
- `nf4`: the base's 4-bit form;
- `peft_format`: PEFT's adapter directories, written and read.

Elsewhere, by layer: `jlong.ops.adapted` (a weight with its adapters, as
the layers compute with it) and `jlong.program.frozen_base` (the step's
split into adapters that train and a base that does not).
"""
