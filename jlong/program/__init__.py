"""The training program: parameter shardings, the optimizer (on the device
or in host memory), the batch layout and the jitted step, built once from a
config and a mesh. The loop runs it, the planner compiles it, the evaluator
runs its forward pass."""
