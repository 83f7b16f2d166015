"""Shared by the experiment scripts: plans through jlong's API for a script's target, result tables."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import jlong
from jlong.planner.maxlen import probe_line

ROOT = Path(__file__).resolve().parents[1]  # the repository
RESULTS = ROOT / "experiments" / "results"
GIB = 2**30
# The default stack on configs/llama3-8b-5m.yaml, whose memory settings are the planner's (memory.remat=auto,
# attention.heads_per_stage=auto): every layer's input in host memory, attention recomputed, U = sp.
DEFAULT_STACK = ["memory.remat=offload_inputs", "memory.remat_runs={}", "attention.heads_per_stage=null"]


def timed(fn, *args):
    """(fn(*args), the seconds it took)."""
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def median_seconds(fn, *args, repeats: int = 5) -> float:
    """Median seconds of fn(*args) after one warm-up call, each call waited for (jax's asynchronous dispatch)."""
    import statistics

    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def per_gpu(result) -> float:
    """A plan's estimated tokens/s per GPU."""
    return result.cost.tokens_per_s / result.cost.devices


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def invocation(script: str, argv: list[str] | None = None) -> str:
    """The command line that ran SCRIPT (a script's __file__) with ARGV
    (sys.argv's arguments by default), as a results file names it."""
    arguments = sys.argv[1:] if argv is None else argv
    return " ".join(["python", f"experiments/{Path(script).name}", *map(portable, arguments)])


def provenance(command: str, compiler: str | None = None,
               how: str = "compiled memory analysis, nothing allocated") -> str:
    """Where and how a result was produced, for the top of a results file: the command, the commit, the
    date, the jax version, the machine, what compiled or ran (COMPILER) and HOW the figures came (no path
    of the machine)."""
    import jax

    compiled = compiler or f"{jax.devices()[0].platform}, {len(jax.devices())} devices"
    return (
        f"Produced by `{command}` at commit {commit() or 'unknown'} on {today()} with jax {jax.__version__} "
        f"on {machine()} ({compiled}): {how}."
    )


def provenance_record(command: str) -> dict:
    """`provenance`'s facts as a JSON results file holds them: command, commit, date, jax version, machine."""
    import jax

    return {"command": command, "commit": commit(), "date": today(), "jax": jax.__version__, "machine": machine()}


def portable(argument: str) -> str:
    """A path or command-line argument as a results file may quote it: relative to the repository,
    never an absolute path of the machine that ran it ("DIR" where it lies elsewhere); in an
    argument KEY=PATH (`--out=/x`, `run_dir=/x`) the path after the first "=" likewise."""
    key, equals, value = argument.partition("=")
    if equals and Path(value).is_absolute() and not Path(argument).is_absolute():
        return f"{key}={portable(value)}"
    path = Path(argument)
    if not path.is_absolute():
        return argument
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "DIR"


def machine() -> str:
    """This machine's processor and cores, as a results file names them."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def commit() -> str | None:
    """The checkout's commit, "+changes" where its tracked files differ from it (results files aside: a script
    writing its own results must not mark them changed); JLONG_SOURCE_COMMIT, where
    set, instead: a copy carried to another machine (a GPU lent for minutes) may bring a stale history along,
    so the command that carries it names the commit, `JLONG_SOURCE_COMMIT=$(git rev-parse --short HEAD)`."""
    if os.environ.get("JLONG_SOURCE_COMMIT"):
        return os.environ["JLONG_SOURCE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  f":(exclude){RESULTS.relative_to(ROOT)}"],
                                 capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+changes" if changed else "")) or None


def publish(name: str, text: str) -> int:
    """Prints a result and writes it to experiments/results/NAME; exit status 0."""
    print(text)
    write_result(name, text)
    return 0


def write_result(name: str, text: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(text)
    return path


def add_target_argument(parser, default: str = "h100") -> None:
    parser.add_argument("--target", default=default,
                        help="what the plans compile for: h100, h200, b200 (XLA:GPU, deviceless; needs "
                        "pip install -e '.[gpu-plan]') or cpu (virtual CPU devices)")


def planning_target(name: str, **budgets):
    """The PlanTarget of `--target`, checked: what every plan of a script
    compiles for and is held to. jax starts with 8 CPU devices, so a script
    can plan for the cpu target too (ablation's CPU proxy, block probes)."""
    from jlong.planner.targets import PlanTarget, resolve_target

    target = PlanTarget(resolve_target(name), **budgets)
    start_cpu_devices(8)
    return target


def plan(config, target) -> jlong.Plan:
    """`jlong.plan` of a config (or YAML path) for the script's target and budgets."""
    return jlong.plan(config, target=target.name, budget_gib=target.budget_gib,
                      host_budget_gib=target.host_budget_gib, gpus_per_node=target.gpus_per_node)


def longest(config, target):
    """`jlong.maxlen` of one config for the script's target and budgets: its
    `jlong.planner.maxlen.MaxLen` (longest length, plan there, probes, binding budget)."""
    [result] = jlong.maxlen(config, target=target.name, budget_gib=target.budget_gib,
                            host_budget_gib=target.host_budget_gib, gpus_per_node=target.gpus_per_node,
                            on_probe=_print_probe)
    if result.refusal:
        raise result.refusal
    return result.found


def _print_probe(seq_len: int, plan) -> None:
    print(probe_line(seq_len, plan), file=sys.stderr, flush=True)


def start_cpu_devices(count: int = 8) -> None:
    """jax on `count` virtual CPU devices, for the scripts that compile single blocks (block_probe)."""
    from jlong.planner.targets import start_planning_backend

    start_planning_backend(cpu_devices=count)


def estimate_assumptions(target_name: str) -> str:
    """The step-cost estimate's assumptions, stated once per result file."""
    from jlong.planner.pricing import Efficiency
    from jlong.planner.step_cost import ESTIMATE_NOTE

    return (f"Every time here is {ESTIMATE_NOTE}. Assumptions: {target_name} data-sheet rates and the default "
            f"efficiencies of `jlong plan` ({Efficiency().describe()}; launch_us per kernel launch).")
