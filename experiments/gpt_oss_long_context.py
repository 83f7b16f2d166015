"""GPT-OSS at long context, planned: gpt-oss-20b at 8,388,608 tokens on one
8xH100 node (configs/gpt-oss-20b-8m.yaml) beside Qwen3-30B-A3B at the same
length with its longest config's settings (configs/qwen3-30b-a3b-9m.yaml),
and gpt-oss-120b on four nodes (configs/gpt-oss-120b-4m-4nodes.yaml).

    python experiments/gpt_oss_long_context.py [--target h100]

Writes experiments/results/gpt-oss-long-context.md. Every time is an
estimate read from a compiled program (deviceless XLA:GPU), never a
measurement. The attention column checks that every attention call runs in
cuDNN with the windows applied: the FLOPs of the compiled program's cuDNN
calls over the FLOPs the layers' windows imply (`Family.flops_per_token`),
run as the policy runs them (forward, backward at 2.5 forwards, and the
forward again where the policy recomputes it: 18/12 of the model's count).
Blockwise attention would count as matmuls, and a window cuDNN did not apply
would price its calls as whole causal ones; either moves the ratio off 1.
"""

from __future__ import annotations

import argparse
import sys

import jlong
from common import GIB, ROOT, add_target_argument, estimate_assumptions, invocation, markdown_table, per_gpu, \
    plan, planning_target, provenance, timed, write_result
from jlong.families import family_of

CONFIGS = ROOT / "configs"
# (what the row is, run config, overrides)
ROWS = [
    ("gpt-oss-20b, one node", "gpt-oss-20b-8m.yaml", []),
    ("Qwen3-30B-A3B at the same length (the 9m config's settings)", "qwen3-30b-a3b-9m.yaml",
     ["train.seq_len=8388608"]),
    ("gpt-oss-120b, four nodes (fsdp 4 x sp 8, one sequence per node)", "gpt-oss-120b-4m-4nodes.yaml", []),
]
# cuDNN's calls per attention layer under a policy that recomputes the forward: forward 4, backward 10 and the
# forward again 4 FLOPs per head dimension and visible key, against the model's 12 (forward 4, backward 8).
RECOMPUTED_ATTENTION = 18 / 12


def attention_in_cudnn(result) -> float:
    """The compiled program's cuDNN attention FLOPs over those the windows imply, forward recomputed."""
    config = result.config
    family, model, S = family_of(config.model), config.model, config.train.seq_len
    per_token = family.flops_per_token(model, S) - family.flops_per_token(model, 0)
    tokens_per_device = S * config.train.batch_size / config.mesh.size
    return result.cost.flops_by_kind.get("attention", 0.0) / (per_token * tokens_per_device * RECOMPUTED_ATTENTION)


def row(name: str, path: str, result, seconds: float) -> list:
    cost, config, memory = result.cost, result.config, result.memory
    return [name, f"configs/{path}", f"{config.mesh.size}", f"{config.train.seq_len:,} x {config.train.batch_size}",
            "yes" if result.fits else "no: " + " and ".join(memory.exceeded),
            f"{result.device_bytes / GIB:.2f} of {memory.budget / GIB:.2f}",
            f"{result.host_bytes_per_node / GIB:,.0f} of {memory.host_budget_per_node / GIB:,.0f}",
            f"{cost.step_time_s:,.0f}", f"{per_gpu(result):,.1f}", f"{cost.mfu:.3f}",
            f"{attention_in_cudnn(result):.3f}", f"{seconds:.0f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows, plans = [], {}
    for name, path, overrides in ROWS:
        result, seconds = timed(plan, jlong.load_config(CONFIGS / path, overrides), target)
        plans[path] = result
        rows.append(row(name, path, result, seconds))
        print(" | ".join(rows[-1]), flush=True)
    small, qwen = plans["gpt-oss-20b-8m.yaml"], plans["qwen3-30b-a3b-9m.yaml"]
    headers = ["model", "config", "GPUs", "seq_len x sequences", "fits", "GiB per device (budget)",
               "host GiB per node (budget)", "est. step s", "est. tokens/s per GPU", "est. MFU",
               "cuDNN attention / windows' attention x 18/12", "planning s"]
    text = "\n\n".join([
        "# GPT-OSS at long context",
        provenance(invocation(__file__, argv), target.compiler()),
        estimate_assumptions(target.name) + " Model FLOPs (MFU) count each token's routed experts only and "
        "the windows' attention (a query of a sliding layer sees at most 128 keys).",
        markdown_table(headers, rows),
        f"At 8,388,608 tokens gpt-oss-20b is estimated at {per_gpu(small):,.1f} tokens/s per GPU against "
        f"Qwen3-30B-A3B's {per_gpu(qwen):,.1f} ({per_gpu(small) / per_gpu(qwen):.2f}x): half of its 24 layers see "
        "128 keys, so its attention work is that of 12 full layers of 64 heads of 64 against Qwen3-30B-A3B's 48 "
        "of 32 heads of 128. The attention column is 1 where every attention call runs in cuDNN, sinks "
        "applied to its output (jlong.attention.sinks), the sliding layers' calls with cuDNN's window. "
        "Qwen3-30B-A3B's program executes more attention forward work than one recompute a layer (its column "
        "above 1, all of it in cuDNN); that is outside this comparison and was not examined here.",
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('gpt-oss-long-context.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
