"""The committed long-context run configs, planned on `--target` (compile-only
H100s by default; nothing is allocated): device and host bytes against the
default budgets, and the compile's wall time. Extra `key=value` overrides
apply to every config, to try a setting across them.

    python experiments/frontier.py [--target h100] [--configs configs/A.yaml ...] [key=value ...]

Without --configs it plans every committed config of 1,048,576 tokens or more.

Writes experiments/results/frontier.md.
"""

from __future__ import annotations

import argparse
import sys
import time

import jlong
from common import GIB, ROOT, add_target_argument, invocation, markdown_table, plan, planning_target, provenance, \
    write_result



def long_context_configs() -> list[str]:
    """Every committed run config of a million tokens or more (the tests plan three of them; the rest, minutes
    each on a small machine, are planned here)."""
    paths = sorted((ROOT / "configs").glob("*.yaml"))
    return [str(path.relative_to(ROOT)) for path in paths if jlong.load_config(path).train.seq_len >= 2**20]


def row(path: str, overrides: list[str], target) -> list:
    config = jlong.load_config(ROOT / path, overrides)
    began = time.perf_counter()
    planned = plan(config, target)
    result = planned.memory
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
            "yes" if result.fits else "no: " + " and ".join(result.exceeded), estimated_per_gpu(planned),
            f"{seconds:.1f}"]


def estimated_per_gpu(planned) -> str:
    """Estimated tokens/s per GPU, read from the compiled program (no estimate on the cpu target); flagged
    where a custom call went unpriced."""
    if planned.cost is None:
        return ""
    unpriced = " (unpriced calls)" if planned.cost.unpriced_custom_calls else ""
    return f"{planned.cost.tokens_per_s / planned.cost.devices:,.1f}{unpriced}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_target_argument(parser)
    parser.add_argument("--configs", nargs="+", help="run configs to plan (default: every one of 1M tokens or more)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    target = planning_target(args.target)
    rows = []
    for path in args.configs or long_context_configs():
        rows.append(row(path, args.overrides, target))
        print(" | ".join(map(str, rows[-1])), flush=True)
    command = invocation(__file__, argv)
    text = "\n\n".join([
        "# The long-context configs, planned",
        provenance(command, target.compiler()),
        "GiB per device (host: per node of 8 GPUs). States: parameters + gradients + optimizer state on the device "
        "(the compute-dtype copies when the optimizer is in host memory). cuDNN workspace: what cuDNN's attention "
        "backward needs beside XLA's buffers (counted by the planner; deviceless compilation shows it empty). Tokens/s per GPU: "
        "an estimate read from the compiled program (never a measurement). Seconds: the plan's wall time "
        "(lowering and compiling) on this machine.",
        markdown_table(["config", "model", "seq_len", "nodes x GPUs: mesh", "remat, layers per checkpoint, optimizer",
                        "states",
                        "temporaries", "cuDNN workspace", "device total", "device budget", "host per node", "host budget", "fits",
                        "est. tokens/s per GPU", "seconds"], rows),
    ]) + "\n"
    print(f"wrote {write_result('frontier.md', text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
