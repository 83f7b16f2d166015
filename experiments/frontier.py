"""The committed long-context run configs, planned on `--target` (compile-only
H100s by default; nothing is allocated): device and host bytes against the
default budgets, and the compile's wall time. Extra `key=value` overrides
apply to every config, to try a setting across them.

    python experiments/frontier.py [--target h100] [--configs configs/A.yaml ...] [key=value ...]

Writes experiments/results/frontier.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import jlong
from common import GIB, ROOT, add_target_argument, invocation, markdown_table, plan, planning_target, provenance, \
    write_result

CONFIGS = [
    "configs/llama3-8b-2m.yaml", "configs/llama3-8b-5m.yaml", "configs/llama3-8b-8m.yaml", "configs/qwen3-32b-3m.yaml",
    "configs/llama3-8b-32m-4nodes.yaml", "configs/llama3-8b-16m-2nodes.yaml", "configs/qwen3-32b-8m-2nodes.yaml",
]


def row(path: str, overrides: list[str], target) -> list:
    config = jlong.load_config(ROOT / path, overrides)
    began = time.perf_counter()
    result = plan(config, target).memory
    seconds = time.perf_counter() - began
    m = config.memory
    knobs = f"{m.remat}, k={m.layers_per_checkpoint}, optimizer {'host' if m.optimizer_offload else 'device'}"
    nodes = config.mesh.size // target.gpus_per_node
    mesh = f"{nodes} x {target.gpus_per_node}: ring {config.mesh.ring} x sp {config.mesh.sp}"
    return [path, config.model.preset, f"{config.train.seq_len:,}", mesh, knobs,
            f"{(result.parameters + result.gradients + result.optimizer_state) / GIB:.2f}",
            f"{result.temporaries / GIB:.2f}", f"{result.cudnn_workspace / GIB:.2f}",
            f"{result.device_total / GIB:.2f}", f"{result.budget / GIB:.2f}",
            f"{result.host_per_node / GIB:,.0f}", f"{result.host_budget_per_node / GIB:,.0f}",
            "yes" if result.fits else "no: " + " and ".join(result.exceeded), f"{seconds:.1f}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--configs", nargs="+", default=CONFIGS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows = []
    for path in args.configs:
        rows.append(row(path, args.overrides, target))
        print(" | ".join(map(str, rows[-1])), flush=True)
    command = invocation(__file__, argv)
    text = "\n\n".join([
        "# The long-context configs, planned",
        provenance(command, target.compiler()),
        "GiB per device (host: per node of 8 GPUs). States: parameters + gradients + optimizer state on the device "
        "(the compute-dtype copies when the optimizer is in host memory). cuDNN workspace: what cuDNN's attention "
        "backward needs beside XLA's buffers (counted by the planner; deviceless compilation shows it empty). Seconds: the plan's wall time "
        "(lowering and compiling) on this machine.",
        markdown_table(["config", "model", "seq_len", "nodes x GPUs: mesh", "remat, layers per checkpoint, optimizer",
                        "states",
                        "temporaries", "cuDNN workspace", "device total", "device budget", "host per node", "host budget", "fits",
                        "seconds"], rows),
    ]) + "\n"
    print(f"wrote {write_result('frontier.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
