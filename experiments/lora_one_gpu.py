"""LoRA and QLoRA at long context on one GPU, planned, beside Unsloth's measured
figures: the longest `train.seq_len` `jlong maxlen` finds for Llama-3.1-8B
(LoRA rank 32 on all linear layers, bf16 base; and the same in NF4, QLoRA,
Unsloth's own setting) and Llama-3.3-70B (QLoRA rank 32, all linear) on one
H100 within 78 GiB of device memory and 128 GiB of host memory, and
Qwen3.5-27B's LoRA on one 8 x H100 node within the default budgets.

    python experiments/lora_one_gpu.py [--target h100] [--cases 8b-lora 8b-qlora 70b-qlora 27b-lora-node]

For each: the search's probes, the plan and estimated step at the longest
length, and where a target length (8B: 1,048,576; 70B: 262,144) is not
reached, the plan there with its parts, to say what binds. Writes
experiments/results/lora-one-gpu.md. Every figure of jlong is a plan (a
deviceless XLA:GPU compile of the train step: memory analysis, and a step
time estimated from the compiled program), never a measurement; Unsloth's
are their measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jlong
from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, longest, markdown_table, \
    plan, planning_target, provenance, timed, write_result

CONFIGS = ROOT / "configs"
ONE_GPU = {"budget_gib": 78.0, "host_budget_gib": 128.0, "gpus_per_node": 1}
ONE_GPU_FLAGS = "--devices 1 --gpus-per-node 1 --budget-gib 78 --host-budget-gib 128"


@dataclasses.dataclass(frozen=True)
class Case:
    key: str
    model: str
    method: str
    config: str  # under configs/
    overrides: tuple[str, ...] = ()
    target_len: int | None = None  # the length the issue asks for (at least)
    one_gpu: bool = True
    # Other settings planned at target_len too, to show what binds under each: (why, overrides).
    alternatives: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def command(self, verb: str, target: str) -> str:
        flags = ONE_GPU_FLAGS if self.one_gpu else ""
        return " ".join(filter(None, ["jlong", verb, f"configs/{self.config}", *self.overrides, "--target", target,
                                      flags]))


CASES = (
    Case("8b-lora", "Llama-3.1-8B", "LoRA r32 all-linear, bf16 base", "llama3.1-8b-lora-1gpu.yaml",
         target_len=1_048_576),
    Case("8b-qlora", "Llama-3.1-8B", "QLoRA r32 all-linear, NF4 base", "llama3.1-8b-lora-1gpu.yaml",
         ("lora.base_dtype=nf4",), target_len=1_048_576),
    Case("70b-qlora", "Llama-3.3-70B", "QLoRA r32 all-linear, NF4 base", "llama3.3-70b-qlora-1gpu.yaml",
         target_len=262_144, alternatives=(("one layer input per four layers (half the host bytes)",
                                            ("memory.layers_per_checkpoint=4",)),)),
    Case("27b-lora-node", "Qwen3.5-27B", "LoRA r32 all-linear, bf16 base", "qwen3.5-27b-lora-4m.yaml",
         one_gpu=False),
)

# What the peak holds, read from XLA's buffer assignment at the target length (python experiments/peak_buffers.py
# CONFIG train.seq_len=N --target h100): the largest buffers live at the fullest point of the step.
PEAK_NOTES = {
    "8b-lora": "At the peak of the step at 1,048,576 tokens (`python experiments/peak_buffers.py "
               "configs/llama3.1-8b-lora-1gpu.yaml train.seq_len=1048576 --target h100`) eight [S, D] buffers of 8 "
               "GiB are live, in the recomputed forward pass of a head stage in the backward pass: the checkpoint "
               "group's two layer inputs, the 32 heads' attention outputs stacked, the layer input's slice, the "
               "residual and its gradient, and two outputs of the stage's output projection, the base's o @ Wo and "
               "the adapter's (o @ a) @ b, each [S, D] before they are added (`jlong.ops.adapted.matmul` forms "
               "the two products apart). The host budget binds next: one input per two layers is 128 GiB at "
               "1,048,576.",
}

# Unsloth's published maxima (their measurements: unsloth.ai/blog/llama3-3 and docs.unsloth.ai's benchmarks
# page): QLoRA rank 32 on q, k, v, o, gate, up, down, batch 1, sequences padded to the length, 80 GB of GPU
# memory (the 70B's on an A100); Hugging Face transformers with FlashAttention-2 beside them.
PUBLISHED = (
    ("Llama-3.1-8B", "Unsloth", "QLoRA r32 all-linear (4-bit base)", 342_733, "one 80 GB GPU"),
    ("Llama-3.1-8B", "transformers + FA2", "QLoRA r32 all-linear (4-bit base)", 28_454, "one 80 GB GPU"),
    ("Llama-3.3-70B", "Unsloth", "QLoRA r32 all-linear (4-bit base)", 89_389, "one A100 80 GB"),
    ("Llama-3.3-70B", "transformers + FA2", "QLoRA r32 all-linear (4-bit base)", 6_916, "one A100 80 GB"),
)


def gib(n: float) -> str:
    return f"{n / GIB:,.2f}"


def layer_buffer_bytes(config) -> int:
    """One [S, D] layer-sized buffer in the compute dtype on one device (the unit the activations come in)."""
    return config.shard_tokens * config.model.hidden_size * 2


def parts(memory, config) -> str:
    """A plan's device bytes by part, with the temporaries in layer-sized buffers."""
    states = memory.trainable_parameters + memory.gradients + memory.optimizer_state
    units = memory.temporaries / layer_buffer_bytes(config)
    return (f"frozen base {gib(memory.frozen_parameters)}, adapters + gradients + AdamW {gib(states)}, "
            f"temporaries {gib(memory.temporaries)} (= {units:.1f} buffers of [S, D] bf16, "
            f"{gib(layer_buffer_bytes(config))} each), cuDNN workspace {gib(memory.cudnn_workspace)}: "
            f"{gib(memory.device_total)} GiB per device against {gib(memory.budget)}; host "
            f"{gib(memory.host_per_node)} GiB against {gib(memory.host_budget_per_node)}")


def run_case(case: Case, target_name: str) -> dict:
    budgets = ONE_GPU if case.one_gpu else {}
    target = planning_target(target_name, **budgets)
    config = jlong.load_config(CONFIGS / case.config, list(case.overrides))
    print(f"{case.key}: {case.command('maxlen', target_name)}", file=sys.stderr, flush=True)
    found, search_s = timed(longest, config, target)
    at_longest = jlong.load_config(CONFIGS / case.config, [*case.overrides, f"train.seq_len={found.seq_len}"])
    planned, plan_s = timed(plan, at_longest, target)
    short, alternatives = None, []
    if case.target_len and found.seq_len < case.target_len:
        at_target = [*case.overrides, f"train.seq_len={case.target_len}"]
        short = plan(jlong.load_config(CONFIGS / case.config, at_target), target)
        alternatives = [(why, overrides, plan(jlong.load_config(CONFIGS / case.config, [*at_target, *overrides]),
                                              target)) for why, overrides in case.alternatives]
    return {"case": case, "found": found, "search_s": search_s, "planned": planned, "plan_s": plan_s,
            "short": short, "alternatives": alternatives}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--cases", nargs="+", default=[c.key for c in CASES], choices=[c.key for c in CASES])
    args = parser.parse_args(argv)
    results = [run_case(case, args.target) for case in CASES if case.key in args.cases]

    comparison, details, binding = [], [], []
    for model, system, method, tokens, hardware in PUBLISHED:
        comparison.append([model, system, method, f"{tokens:,}", "measured (theirs)", hardware])
    for r in results:
        case, found, planned = r["case"], r["found"], r["planned"]
        cost = planned.cost
        where = "one H100 80GB: 78 GiB, 128 GiB host" if case.one_gpu else \
            f"one 8 x H100 node: {gib(found.plan.budget)} GiB per GPU, {gib(found.plan.host_budget_per_node)} GiB host"
        comparison.append([case.model, "jlong", case.method, f"{found.seq_len:,}",
                           f"plan (the {found.bound_by} budget binds)", where])
        details.append([f"`{case.config}`" + (f" {' '.join(case.overrides)}" if case.overrides else ""),
                        f"{found.seq_len:,}", gib(planned.memory.frozen_parameters),
                        gib(planned.memory.trainable_parameters + planned.memory.gradients
                            + planned.memory.optimizer_state),
                        gib(planned.memory.temporaries), gib(planned.device_bytes),
                        f"{planned.host_bytes_per_node / GIB:,.1f}", found.bound_by,
                        f"{cost.step_time_s:,.0f}" if cost else "", f"{cost.tokens_per_s:,.0f}" if cost else "",
                        f"{cost.mfu:.1%}" if cost else "", f"{cost.recompute_factor:.2f}" if cost else "",
                        f"{len(found.probes)} in {r['search_s']:.0f}"])
        if r["short"] is not None and r["short"].fits:  # the search stops within 1% (or a granule) of the longest
            binding.append(f"- {case.model} {case.method} at {case.target_len:,} tokens: "
                           f"{parts(r['short'].memory, r['short'].config)}: it fits both budgets (the search "
                           f"stopped at {found.seq_len:,}, within its 1% resolution).")
        elif r["short"] is not None:
            short = r["short"]
            binding.append(f"- {case.model} {case.method} at {case.target_len:,} tokens: "
                           f"{parts(short.memory, short.config)}. Over: the "
                           f"{' and '.join(short.memory.exceeded)} budget; the longest that fits is "
                           f"{found.seq_len:,} ({found.seq_len / case.target_len:.1%} of the target).")
            for why, overrides, other in r["alternatives"]:
                binding.append(f"  - with {why} (`{' '.join(overrides)}`) at {case.target_len:,}: "
                               f"{parts(other.memory, other.config)}. Over: the "
                               f"{' and '.join(other.memory.exceeded) or 'none'} budget.")
            if case.key in PEAK_NOTES:
                binding.append(f"  - {PEAK_NOTES[case.key]}")
        elif case.target_len:
            binding.append(f"- {case.model} {case.method}: {found.seq_len:,} tokens reach the target "
                           f"{case.target_len:,}.")

    by_key = {r["case"].key: r["found"].seq_len for r in results}
    ratios = []
    for key, model, theirs in (("8b-lora", "Llama-3.1-8B LoRA (bf16 base)", 342_733),
                               ("8b-qlora", "Llama-3.1-8B QLoRA", 342_733), ("70b-qlora", "Llama-3.3-70B QLoRA", 89_389)):
        if key in by_key:
            ratios.append(f"{model}: {by_key[key]:,} planned / {theirs:,} measured by Unsloth = "
                          f"{by_key[key] / theirs:.2f}x")
    if "27b-lora-node" in by_key:  # full fine-tuning's longest on one node, as README.md's table plans it
        ratios.append(f"Qwen3.5-27B LoRA on one node: {by_key['27b-lora-node']:,} planned, against 3,948,544 planned "
                      "for full fine-tuning with its optimizer in host memory (configs/qwen3.5-27b-3m.yaml's "
                      "settings): the base has no gradient and no optimizer state to hold")

    text = "\n\n".join([
        "# LoRA and QLoRA at long context on one GPU",
        provenance(invocation(__file__, argv), planning_target(args.target).compiler()),
        "**Plan** = jlong's figure: the train step compiled deviceless by XLA:GPU for H100s (memory analysis of "
        "the compiled program; nothing allocated, nothing run), searched by `jlong maxlen`'s doubling and bisection. "
        "**Measured** = another system's published measurement on its own hardware. A plan is an estimate of "
        "what the run would need, not a run (experiments/lora_gpu_check.py checks plans against a GPU).",
        "## Longest context, plan beside measured",
        markdown_table(["model", "system", "method", "longest context (tokens)", "kind", "hardware and budgets"],
                       comparison),
        "\n".join(f"- {line}" for line in ratios),
        "Unsloth's figures: unsloth.ai/blog/llama3-3 and docs.unsloth.ai's benchmarks page (QLoRA rank 32 on q, k, "
        "v, o, gate, up, down; batch 1; sequences padded to the length; their gradient checkpointing offloads "
        "activations to host memory, whose size they do not state). jlong's bf16-base LoRA keeps 15 GiB of "
        "Llama-3.1-8B's weights in 16 bits where Unsloth's QLoRA keeps 4.5; the QLoRA row is the like-for-like "
        "one. Their 70B ran on an A100 (80 GB), jlong plans for an H100 (80 GB); the memory is the same size.",
        "## The plans",
        "GiB per device (host: per node). States: adapters in float32 with their gradients and AdamW moments (the "
        "frozen base has neither). Step time, tokens/s and MFU are estimates read from the compiled program; MFU "
        "counts LoRA's model FLOPs (4 per frozen matmul parameter and token, 6 per adapter parameter, plus "
        "attention: `jlong.planner.flops`).",
        markdown_table(["config", "longest seq_len", "frozen base", "adapter states", "temporaries", "device total",
                        "host GiB", "binds", "est. step s", "est. tokens/s", "est. MFU", "executed / model",
                        "plans (seconds)"], details),
        "## What binds",
        "\n".join(binding) if binding else "Every target length is reached.",
        "## Commands",
        "\n".join(f"    {r['case'].command(verb, args.target)}" for r in results for verb in ("maxlen", "plan")),
        "The plan at the longest length: the same `jlong plan` with `train.seq_len=N`. "
        + estimate_assumptions(args.target),
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('lora-one-gpu.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
