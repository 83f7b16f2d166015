"""GRPO at 131,072-token prompts, planned: `jlong plan` of configs/qwen3-8b-grpo-128k.yaml and
configs/qwen3.5-9b-grpo-128k.yaml (one 8xH100 node, 8 completions of up to 4,096 tokens a prompt) for the h100
target, deviceless: the training step and the rollout (the sampler's prefill and decode), each compiled and
priced. Memory is compiled; times are estimates read from the compiled programs, not measurements. No prompts
file is read.

    python experiments/grpo_plan.py [--target h100]

Writes experiments/results/grpo-128k.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import sys

from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, planning_target, provenance, \
    provenance_record, write_result

CONFIGS = ("qwen3-8b-grpo-128k", "qwen3.5-9b-grpo-128k")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    args = parser.parse_args()
    target = planning_target(args.target)

    import jlong
    from jlong.planner.rollout import plan_rollout

    rows, records = [], {}
    for name in CONFIGS:
        config = jlong.load_config(ROOT / "configs" / f"{name}.yaml")
        training = jlong.plan(config, target=target.name)
        rollout = plan_rollout(training.config, target, training.memory, training.step_time_s)
        records[name] = {"training": training.as_dict(), "rollout": rollout.as_dict()}
        generation = rollout.generation
        rows.append(f"| {name} | {training.memory.device_total / GIB:.2f} | {rollout.device_total / GIB:.2f} | "
                    f"{generation.cache / GIB:.2f} | {generation.prefill_s:,.1f} | {generation.decode_step_s * 1e3:,.1f} | "
                    f"{rollout.rollout_s:,.1f} | {training.step_time_s:,.1f} | {rollout.step_s:,.1f} |")
    command = invocation(__file__)
    write_result("grpo-128k.json", json.dumps({**provenance_record(command), "configs": records}, indent=2) + "\n")
    text = "\n".join([
        "# GRPO at 131,072-token prompts on one 8xH100 node, planned", "",
        provenance(command, compiler=target.compiler(), how="compiled memory analysis, nothing allocated; times "
                   "estimated from the compiled programs"), "",
        "One prompt of 131,072 tokens a step, 8 completions of up to 4,096 tokens (a step's rows: 8 x 135,168 tokens);"
        " the rollout's decode steps all run to 4,096 tokens. GiB per device; seconds and milliseconds estimated.", "",
        "| config | training GiB | rollout GiB | caches GiB | prefill s | decode step ms | rollout s | training s | "
        "GRPO step s |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows, "",
        "The rollout holds the optimizer's state it does not use beside its own programs, and decodes with the "
        "weights gathered once from their shards (they fit whole on a GPU). "
        + estimate_assumptions(target.name), "",
    ])
    write_result("grpo-128k.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
