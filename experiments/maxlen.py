"""The longest Llama3-8B context on one 8-GPU node, as `jlong maxlen` finds it:
with UPipe (U = C = 8) and without (plain Ulysses), within both default
budgets (device memory per GPU, host memory per node), and within the device
budget alone (host memory unbounded) to show what the host budget costs.

    python experiments/maxlen.py [--target h100] [--config configs/llama3-8b-5m.yaml]

Writes experiments/results/maxlen.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jlong
from common import GIB, ROOT, add_target_argument, longest, invocation, markdown_table, planning_target, \
    provenance, write_result

CONFIGS = ROOT / "configs"
UNBOUNDED_HOST_GIB = 1e9
VARIANTS = [("UPipe (U = 8)", ["attention.heads_per_stage=8"]), ("plain Ulysses (U = all heads)", ["attention.heads_per_stage=all"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIGS / "llama3-8b-5m.yaml"))
    add_target_argument(parser)
    args = parser.parse_args()

    target = planning_target(args.target)
    rows = []
    for name, overrides in VARIANTS:
        config = jlong.load_config(args.config, overrides)
        for host_limit, limited in ((target.host_budget_gib, True), (UNBOUNDED_HOST_GIB, False)):
            searched = dataclasses.replace(target, host_budget_gib=host_limit)
            started = time.perf_counter()
            found = longest(config, searched)
            seconds = time.perf_counter() - started
            budgets = "device and host" if limited else "device only"
            best = found.plan
            rows.append([name, budgets, f"{found.seq_len:,}", f"{best.device_total / GIB:.2f}",
                         f"{best.host_per_node / GIB:,.0f}", found.bound_by, len(found.probes), f"{seconds:.0f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    budget = target.device_budget_gib(jlong.load_config(args.config).train.gpu_memory_fraction)
    text = "\n\n".join([
        "# Longest context on one node",
        provenance(invocation(__file__), target.compiler()),
        f"`{Path(args.config).name}` (Llama3-8B, sp = 8, offload_inputs, MLP tile 2048, loss tile 1024) searched by "
        f"`jlong maxlen`'s doubling and bisection. Budgets: {budget:.2f} GiB per device (the default: "
        f"train.gpu_memory_fraction of the device less the reserve) and {target.host_budget_gib:,.0f} GiB of "
        "host memory per node of 8 devices; 'device only' lifts the host budget.",
        markdown_table(["attention", "budgets", "longest seq_len", "device GiB", "host GiB per node",
                        "budget that binds", "plans", "seconds"], rows),
    ]) + "\n"
    print(text)
    print(f"wrote {write_result('maxlen.md', text)}")


if __name__ == "__main__":
    main()
