"""The planner: what a configured train step needs, read from its compiled
program before any device runs it.

- `targets`: what a plan compiles for (XLA:GPU for compile-only H100, H200
  or B200 nodes, or virtual CPU devices), the hardware figures, the budgets;
- `gpu_memory`: the share of each GPU a run asks XLA for;
- `memory`: per-device and host bytes of the compiled step (`jlong plan`);
- `hlo` and `step_cost`: FLOPs, traffic, kernel launches and an estimated
  step time read from the compiled program;
- `maxlen`: the longest sequence that fits, and the search over settings;
- `memory_choice`: `memory.remat=auto` and `attention.heads_per_stage=auto`,
  chosen to fill both budgets;
- `advice`: one-line reports of memory that runs out, with what to change;
- `probe`: per-block temporaries, for the memory experiments.

Nothing here imports jax at package import: the command line reads the
targets' names before it has set jax up.
"""
