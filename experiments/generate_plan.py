"""Generation at a 1,048,576-token prompt, planned: `jlong plan --generate` of
configs/qwen3-8b-generate-1m.yaml (Qwen3-8B on one 8xH100 node, sp 8) for
the h100 target, deviceless. Memory is compiled; times are estimates read
from the compiled programs, not measurements.

    python experiments/generate_plan.py [--target h100] [--new-tokens 1024] [--batch 1]

Writes experiments/results/generate-1m.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import sys

from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, planning_target, provenance, \
    provenance_record, write_result

CONFIG = ROOT / "configs" / "qwen3-8b-generate-1m.yaml"
PROMPT_TOKENS = 1_048_576


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    target = planning_target(args.target)

    import jlong
    from jlong.planner.generation import format_generation_plan, plan_generation

    config = jlong.load_config(CONFIG)
    planned = plan_generation(config, target, prompt_tokens=PROMPT_TOKENS, new_tokens=args.new_tokens,
                              batch=args.batch)
    command = invocation(__file__)
    write_result("generate-1m.json", json.dumps({**provenance_record(command), **planned.as_dict()}, indent=2) + "\n")
    text = "\n".join([
        "# Generation after a 1,048,576-token prompt: Qwen3-8B on one 8xH100 node", "",
        provenance(command, compiler=target.compiler(), how="compiled memory analysis, nothing allocated; times "
                   "estimated from the compiled programs"), "",
        "```", format_generation_plan(planned, config), "```", "",
        f"Each GPU holds {planned.cache / GIB:.2f} GiB of caches: its 131,072 tokens of every layer's keys and "
        "values (the prompt stays split over the 8 GPUs as the prefill split it), and its share of the new tokens' "
        "slots. A decode step reads every layer's weights, held as the plan's line above says, and this GPU's part "
        "of the cache, and merges the one new query's partial softmax over the 8 GPUs. The floor counts those "
        "bytes read once from HBM and nothing else; the estimate prices the compiled decode program's kernels and "
        "collectives in schedule order.", "",
        estimate_assumptions(target.name), "",
    ])
    write_result("generate-1m.md", text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
