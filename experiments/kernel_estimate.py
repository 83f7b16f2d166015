"""jlong's GPU kernels as the planner prices them, without a GPU: each
compiled deviceless for one H100 at the race's main shapes and priced by
the step-cost roofline, with the operations that move the most memory.

    python experiments/kernel_estimate.py [--tokens 32768] [--heads 16] [--top 12]

- the Triton gated delta rules, forward and forward + backward, at TOKENS x
  HEADS heads of 128 in bf16: `triton` (the chunk terms, the recurrence
  kernels, the outputs and every gradient as kernels) and
  `triton_recurrence` (the recurrence kernels alone, XLA's products around
  them);
- the grouped matmul (Triton and Mosaic GPU) forward + backward at
  Qwen3-30B-A3B's 65,536 routed rows, 2048 -> 768, 128 experts.

Writes experiments/results/kernel-estimate.md. Every figure is an estimate
read from the compiled program on data-sheet rates and `jlong plan`'s
efficiencies (the kernels' own from the race; a kernel never run on a GPU at
a measured sibling's, and named so), never a measurement: it is for seeing
where a change moves memory traffic between GPU sessions.
Needs the CUDA plugin (pip install -e '.[gpu-plan]'); about 15 s here.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys

import jax
import jax.numpy as jnp

from common import estimate_assumptions, invocation, markdown_table, provenance, publish
from jlong.linear_attention.gated_delta import rule as gated_delta_rule
from jlong.moe import grouped_matmul_mosaic, grouped_matmul_triton
from jlong.planner.hlo import parse_module
from jlong.planner.pricing import Efficiency
from jlong.planner.step_cost import estimate
from jlong.planner.targets import GPUS, PlanTarget

GROUPED_ROWS = 65_536
SKIPPED = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast")


def compiled_text(fn, *shapes) -> str:
    return jax.jit(fn).lower(*shapes).compile().as_text()


def priced(text: str, tokens: int) -> dict:
    cost = estimate(parse_module(text), gpu=GPUS["h100"], efficiency=Efficiency(), node_of=[0],
                    tokens_per_step=tokens, model_flops_per_device=1.0)
    return {"ms": cost.step_time_s * 1e3, "hbm_gb": cost.hbm_bytes / 1e9, "kernels": cost.kernels,
            "by_kind": {kind: seconds * 1e3 for kind, seconds in cost.time_by_kind.items()},
            "unmeasured": sorted(cost.unmeasured_kernels)}


def heaviest(text: str, top: int) -> list[list]:
    """The `top` operations of the program by the bytes they read and write (loop bodies included once)."""
    module = parse_module(text)
    rows = []

    def walk(computation):
        for inst in computation.instructions:
            if inst.opcode in SKIPPED:
                continue
            if inst.opcode == "while":
                for name in inst.called:
                    if name in module.computations:
                        walk(module.computations[name])
                continue
            moved = sum(a.bytes for a in inst.arrays) + sum(a.bytes for a in computation.operand_arrays(inst))
            name = re.search(r'op_name="([^"]*)"', inst.attributes)
            rows.append([moved / 1e9, inst.opcode, name.group(1).rsplit("/", 2)[-2:] if name else ""])

    walk(module.entry_computation)
    rows.sort(key=lambda r: -r[0])
    return [[f"{moved:.2f}", opcode, "/".join(where)] for moved, opcode, where in rows[:top]]


def gated_delta(tokens: int, heads: int, spec, kernel: str = "triton") -> dict:
    shapes = [spec(1, tokens, heads, 128)] * 3 + [spec(1, tokens, heads, dtype=jnp.float32)] * 2
    cotangent = spec(1, tokens, heads, 128)
    rule = gated_delta_rule(kernel)

    def forward(q, k, v, g, beta, do):
        return rule(q, k, v, g, beta)[0]

    def both(q, k, v, g, beta, do):  # o and the gradients, as the race times them
        o, pullback = jax.vjp(lambda *a: rule(*a)[0], q, k, v, g, beta)
        return o, *pullback(do)

    return {pass_: compiled_text(fn, *shapes, cotangent) for pass_, fn in (("fwd", forward), ("fwd+bwd", both))}


def grouped(module, spec) -> str:
    rows, hidden, intermediate, experts = GROUPED_ROWS, 2048, 768, 128

    def both(x, w, sizes, dy):  # the product and both gradients, as the race times them
        y, pullback = jax.vjp(lambda x, w: module.grouped_matmul(x, w, sizes), x, w)
        return y, *pullback(dy)

    return compiled_text(both, spec(rows, hidden), spec(experts, hidden, intermediate),
                         spec(experts, dtype=jnp.int32), spec(rows, intermediate))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--top", type=int, default=12, help="operations listed by memory traffic")
    args = parser.parse_args(argv)
    device = PlanTarget("h100").devices(1)[0]  # a one-line error without the CUDA plugin
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731

    programs = {f"gated delta ({kernel}) {p}": (text, args.tokens, None)
                for kernel in ("triton", "triton_recurrence")
                for p, text in gated_delta(args.tokens, args.heads, spec, kernel).items()}
    flops = 3 * 2.0 * GROUPED_ROWS * 2048 * 768  # forward, input gradient, weight gradient
    for name, module in (("Triton", grouped_matmul_triton), ("Mosaic GPU", grouped_matmul_mosaic)):
        programs[f"grouped matmul ({name}) fwd+bwd"] = (grouped(module, spec), GROUPED_ROWS, flops)
    rows, sections = [], []
    for name, (text, tokens, work) in programs.items():
        cost = priced(text, tokens)
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(cost["by_kind"].items(), key=lambda kv: -kv[1]))
        rate = f"{work / cost['ms'] / 1e9:.0f} TFLOP/s" if work else f"{tokens / cost['ms'] / 1e3:.2f} M tokens/s"
        rows.append([name, f"{cost['ms']:.2f}", rate, f"{cost['hbm_gb']:.1f}", int(cost["kernels"]), kinds,
                     ", ".join(cost["unmeasured"]) or "none"])
        sections.append(f"### {name}: the heaviest operations\n\n"
                        + markdown_table(["GB moved", "opcode", "where"], heaviest(text, args.top)))
    shape = f"{args.tokens:,} tokens x {args.heads} heads of 128"
    text = "\n".join([
        "# jlong's GPU kernels, priced without a GPU (estimates)",
        "",
        provenance(invocation(__file__, argv), compiler="XLA:GPU for one H100, deviceless",
                   how="the step-cost roofline over the compiled program"),
        "",
        estimate_assumptions("h100") + " Not measurements: the race (kernel_race.py) measures.",
        "",
        f"Gated delta: {shape}, bf16; grouped matmul: 65,536 rows, 2048 -> 768, 128 experts, bf16.",
        "",
        "The last column names the kernels never run on a GPU (no race recorded for them: "
        "experiments/results/kernel-runs.json), priced at a measured sibling's rate: those estimates rest on "
        "kernels nobody has timed.",
        "",
        markdown_table(["program", "est. ms", "est. rate", "HBM GB", "kernels", "ms by kind",
                        "priced without a measurement"], rows),
        "",
        "\n\n".join(sections),
        "",
    ])
    return publish("kernel-estimate.md", text)


if __name__ == "__main__":
    sys.exit(main())
