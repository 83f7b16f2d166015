"""The one-GPU LoRA and QLoRA plans against one GPU, within about three minutes.

    python experiments/lora_gpu_check.py --plan              # any machine with the CUDA plugin: the deviceless plans
    python experiments/lora_gpu_check.py [--out DIR]         # one H100 (or H200): the check itself
    python experiments/lora_gpu_check.py --rehearse --out DIR  # the same pipeline, tiny shapes, on the CPU

configs/llama3.1-8b-lora-1gpu.yaml and configs/llama3.3-70b-qlora-1gpu.yaml cut to four layers (two
checkpoint groups of two, as the whole configs' groups, each group's input in host memory): per layer
everything is as in the whole run but the frozen base is smaller. Each case in its own process, one
after another:

- `run` cases: the train step compiled for this GPU, then steps on random tokens; the median step time
  after the first and the device's peak bytes (`peak_bytes_in_use`), beside the plan of the same
  config (`--plan`'s deviceless XLA:GPU compile, recorded in PLANNED: planned device bytes and the
  estimated step time) and the memory analysis of this GPU's own compile of it. One step of four
  layers at the whole configs' lengths takes minutes (est. about 420 s for the 8B's attention at
  1,048,576 tokens, 64 s for the 70B's at 208,896), so they run shorter (98,304 and 49,152 tokens: est. 8.5 s
  and 10 s a step, three steps each);
- `compile` cases: the configs' own lengths, compiled for this GPU and not run: its memory analysis
  beside the deviceless plan (the same compiler on a real device against none).

The run holds itself to --deadline-s (170 by default; the device's time counts from its start): a case
whose estimate does not fit what is left is skipped, and one past its time is stopped; both are said in
the results. XLA's autotuning is off (as in a deviceless compile, whose programs the plans read) unless
--autotune. Writes lora-gpu-check.json and .md into --out (default experiments/results). Without a GPU
and without --rehearse or --plan it exits 2 with one line.

On a GPU machine lent for minutes, from the repository, with jlong's dependencies there (qwix, which
holds the NF4 base, and pydantic were not on the lent machines' image as last listed: carry their
wheels), the commit named from this side because the carried history may be stale:

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \\
        JLONG_SOURCE_COMMIT=COMMIT python3 experiments/lora_gpu_check.py --out "$OUT"

The plans it reads (experiments/results/lora-gpu-check-plan.json) are committed; `--plan` makes them again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from jlong.jax_startup import import_jax_quietly

import_jax_quietly()  # before anything imports jax: no CUDA plugin's "no driver" lines on a CPU machine

from common import (  # noqa: E402 (imports jax)
    GIB, ROOT, commit, invocation, machine, markdown_table, portable, provenance_record, today)

HERE = Path(__file__).resolve()
PLANNED = ROOT / "experiments" / "results" / "lora-gpu-check-plan.json"
EIGHT_B = "configs/llama3.1-8b-lora-1gpu.yaml"
SEVENTY_B = "configs/llama3.3-70b-qlora-1gpu.yaml"
FOUR_LAYERS = ("model.num_hidden_layers=4",)
BUDGETS = {"budget_gib": 78.0, "host_budget_gib": 128.0, "gpus_per_node": 1}
PROCESS_START_S = 25  # a child's jax start and the program's construction, on top of its compile and steps


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    config: str
    overrides: tuple[str, ...]
    run: bool  # False: compiled for the GPU and not run
    steps: int = 3
    limit_s: float = 100  # this case's own deadline

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


GPU_CASES = (
    Case("8B LoRA, 4 layers, 98,304 tokens", EIGHT_B, (*FOUR_LAYERS, "train.seq_len=98304"), run=True),
    Case("70B QLoRA, 4 layers, 49,152 tokens", SEVENTY_B, (*FOUR_LAYERS, "train.seq_len=49152"), run=True),
    Case("8B LoRA, 4 layers, the config's 1,048,576 tokens", EIGHT_B, FOUR_LAYERS, run=False, limit_s=60),
    Case("70B QLoRA, 4 layers, the config's 208,896 tokens", SEVENTY_B, FOUR_LAYERS, run=False, limit_s=60),
)
# The rehearsal: the same pipeline on tiny shapes (the configs' stacks, the models shrunk), on the CPU.
TINY = ("model.vocab_size=256", "model.hidden_size=128", "model.intermediate_size=256", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.head_dim=32", "memory.mlp_tile=256", "memory.loss_tile=256",
        "attention.impl=blockwise", "attention.block_size=256", "train.compute_dtype=float32")
REHEARSAL_CASES = (
    Case("tiny LoRA, 4 layers, 1,024 tokens", EIGHT_B, (*FOUR_LAYERS, *TINY, "train.seq_len=1024"), run=True),
    Case("tiny QLoRA, 4 layers, 1,024 tokens", SEVENTY_B, (*FOUR_LAYERS, *TINY, "train.seq_len=1024"), run=True),
    Case("tiny LoRA, 4 layers, 2,048 tokens", EIGHT_B, (*FOUR_LAYERS, *TINY, "train.seq_len=2048"), run=False),
)


# --------------------------------------------------------------------------------------------------
# One case, in its own process


def child(spec: dict, target_name: str, autotune: bool) -> dict:
    """Compiles (and runs) one case on this process's first device; what it measured."""
    from jlong.config import load_config
    from jlong.planner.gpu_memory import apply_memory_fraction

    case = Case(**{**spec, "overrides": tuple(spec["overrides"])})
    config = load_config(ROOT / case.config, list(case.overrides))
    if target_name != "cpu":
        apply_memory_fraction(config.train.gpu_memory_fraction)  # before jax starts the GPU
        if not autotune:
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    from jlong.jax_startup import start_backends

    start_backends(cpu_devices=1)
    import jax

    from jlong.data.sources import Batches
    from jlong.parallel.placement import make_mesh
    from jlong.planner.memory import CompiledStep, plan_of
    from jlong.planner.step_cost import step_cost
    from jlong.planner.targets import PlanTarget
    from jlong.program.train_program import TrainProgram

    devices = jax.devices()[:1]
    program = TrainProgram(config, make_mesh(config.mesh, devices))
    began = time.perf_counter()
    compiled = program.lower().compile()
    result = {"compile_s": time.perf_counter() - began, "device_kind": devices[0].device_kind}
    own = CompiledStep(program, compiled, PlanTarget(target_name, **BUDGETS), devices)
    memory = plan_of(own)
    cost = step_cost(own) if target_name != "cpu" else None
    result.update(compiled_device_bytes=memory.device_total, compiled_host_bytes=memory.host_per_node,
                  compiled_estimated_step_s=cost.step_time_s if cost else None)
    if case.run:
        params = program.init_params(config.train.seed)
        state = program.init_opt_state(params)
        batches = Batches.from_config(config)
        times, losses, step_fn = [], [], compiled
        for step in range(1, case.steps + 1):
            batch = program.place_batch(batches.batch(step))
            began = time.perf_counter()
            try:
                params, state, metrics = step_fn(params, state, batch)
            except ValueError as err:  # the compiled step wants the 4-bit codes packed; XLA:CPU's arrays are not
                if step_fn is not compiled or "layouts" not in str(err):
                    raise
                result["aot_layout_mismatch"] = str(err).splitlines()[0]
                step_fn = program.step  # jit: compiles again, for the arrays' layouts
                params, state, metrics = step_fn(params, state, batch)
            losses.append(float(jax.block_until_ready(metrics["loss"])))
            times.append(time.perf_counter() - began)
        stats = devices[0].memory_stats() or {}
        result.update(step_s=times, median_step_s=statistics.median(times[1:] or times), losses=losses,
                      measured_peak_bytes=stats.get("peak_bytes_in_use"))
    return result


def run_child(case: Case, target_name: str, autotune: bool, timeout: float) -> dict:
    command = [sys.executable, str(HERE), "--child", json.dumps(case.as_dict()), "--child-target", target_name]
    if autotune:
        command.append("--autotune")
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT / "experiments")
    except subprocess.TimeoutExpired:
        return {"status": f"stopped at its deadline ({timeout:.0f} s)", "wall_s": time.perf_counter() - began}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {"status": f"failed: {tail}", "wall_s": time.perf_counter() - began}
    return {"status": "ok", "wall_s": time.perf_counter() - began, **json.loads(lines[-1])}


# --------------------------------------------------------------------------------------------------
# The deviceless plans (--plan) and the check


def deviceless_plans(cases, target_name: str) -> dict:
    """Each case's plan, compiled deviceless for `target_name` (XLA:GPU; or the cpu target in a rehearsal)."""
    import jlong

    plans = {}
    for case in cases:
        print(f"planning {case.name} ...", file=sys.stderr, flush=True)
        planned = jlong.plan(ROOT / case.config, list(case.overrides), target=target_name, **BUDGETS)
        plans[case.name] = {"device_bytes": planned.device_bytes, "host_bytes": planned.host_bytes_per_node,
                            "estimated_step_s": planned.step_time_s, "fits": planned.fits}
    return plans


def estimate_s(case: Case, planned: dict | None) -> float:
    """What a case should take: the process, a compile, and its steps at the estimated step time."""
    step = (planned or {}).get("estimated_step_s") or 0.0
    return PROCESS_START_S + 30 + (case.steps * step if case.run else 0)


def check(cases, plans: dict, target_name: str, autotune: bool, deadline_s: float) -> list[dict]:
    ends = time.monotonic() + deadline_s
    rows = []
    for case in cases:
        planned = plans.get(case.name)
        left = ends - time.monotonic()
        row = {"case": case.as_dict(), "planned": planned}
        if estimate_s(case, planned) > left:
            row.update(status=f"skipped: estimated {estimate_s(case, planned):.0f} s, {left:.0f} s left")
        else:
            print(f"{case.name} ...", file=sys.stderr, flush=True)
            row.update(run_child(case, target_name, autotune, min(case.limit_s, left)))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def ratio(measured, planned) -> str:
    return f"{measured / planned:.3f}" if isinstance(measured, (int, float)) and planned else "-"


def report(rows: list[dict], device: str, rehearsal: bool, command: str, deadline_s: float, wall_s: float) -> str:
    table = []
    for row in rows:
        planned = row.get("planned") or {}
        peak = row.get("measured_peak_bytes")
        table.append([row["case"]["name"], "run" if row["case"]["run"] else "compile", row["status"],
                      gib(planned.get("device_bytes")), gib(row.get("compiled_device_bytes")), gib(peak),
                      ratio(peak, planned.get("device_bytes")),
                      f"{planned['estimated_step_s']:.1f}" if planned.get("estimated_step_s") else "-",
                      f"{row['median_step_s']:.1f}" if row.get("median_step_s") else "-",
                      f"{row['compile_s']:.0f}" if row.get("compile_s") else "-"])
    mismatched = [row["case"]["name"] for row in rows if row.get("aot_layout_mismatch")]
    notes = [f"The compiled step refused the step's own arrays for {', '.join(mismatched)} (its 4-bit codes "
             "compiled packed, the arrays unpacked: the error `jlong train` would stop with), so those ran "
             "through `TrainProgram.step` (jit), compiled again."] if mismatched else []
    return "\n\n".join([
        "# The one-GPU LoRA plans against one GPU" + (" (a CPU rehearsal)" if rehearsal else ""),
        f"`{command}` at commit {commit() or 'unknown'} on {today()} on {device} "
        f"(host: {machine()}); {wall_s:.0f} s of the {deadline_s:.0f} s deadline.",
        "Planned: the deviceless XLA:GPU plan of the same config (`--plan`, recorded in "
        f"`{portable(str(PLANNED))}`), device bytes and estimated step time (estimates, not measurements). "
        "Compiled: the memory analysis of this device's own compile of the step. Measured: the device's "
        "`peak_bytes_in_use` after the steps, and the median step after the first. GiB per device.",
        markdown_table(["case", "kind", "status", "planned GiB", "compiled GiB", "measured peak GiB",
                        "measured / planned", "est. step s", "measured step s", "compile s"], table),
        *notes,
    ]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="compile the cases deviceless for --target and record "
                        f"the plans in {portable(str(PLANNED))} (no GPU needed)")
    parser.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--target", default="h100", help="the GPU the plans are for (h100, h200)")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    parser.add_argument("--deadline-s", type=float, default=170.0)
    parser.add_argument("--autotune", action="store_true", help="let XLA autotune the GPU's kernels")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-target", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.child_target, args.autotune)), flush=True)
        return 0
    cases = REHEARSAL_CASES if args.rehearse else GPU_CASES
    if args.plan:
        PLANNED.write_text(json.dumps({"target": args.target, "commit": commit(),
                                       "provenance": provenance_record(invocation(__file__, argv)), "budgets": BUDGETS,
                                       "plans": deviceless_plans(cases, args.target)}, indent=1) + "\n")
        print(f"wrote {PLANNED}")
        return 0
    probe = subprocess.run([sys.executable, "-c", "import jax; d = jax.devices()[0]; print(d.platform, d.device_kind, "
                            "sep='|')"], capture_output=True, text=True)
    platform, _, kind = probe.stdout.strip().partition("|")
    if platform != "gpu" and not args.rehearse:
        print("lora_gpu_check needs a GPU (this machine has none); --rehearse runs the pipeline on the CPU, --plan "
              "makes the deviceless plans", file=sys.stderr)
        return 2
    began = time.perf_counter()
    if args.rehearse:
        target_name, plans = "cpu", deviceless_plans(cases, "cpu")
    else:
        target_name = args.target
        plans = json.loads(PLANNED.read_text())["plans"] if PLANNED.is_file() else {}
    rows = check(cases, plans, target_name, args.autotune, args.deadline_s)
    wall_s = time.perf_counter() - began
    import jax

    command = invocation(__file__, argv)
    data = {"device": {"platform": platform, "kind": kind}, "versions": {"jax": jax.__version__},
            "commit": commit(), "command": command, "date": today(), "machine": machine(),
            "rehearsal": args.rehearse, "deadline_s": args.deadline_s, "wall_s": wall_s,
            "cases": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora-gpu-check.json").write_text(json.dumps(data, indent=1) + "\n")
    text = report(rows, f"{kind} ({platform}), jax {jax.__version__}", args.rehearse, command, args.deadline_s,
                  wall_s)
    (args.out / "lora-gpu-check.md").write_text(text)
    print(text)
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
