"""The README's main job as a user meets it: a fresh clone of this checkout's commit, then the README's first
command in it (a virtual environment, `pip install -e .`, `jlong prepare` on Python's standard library,
`jlong train configs/tiny.yaml`), timed from the clone.

    python experiments/main_job.py [--commit REV]   # default: this checkout's HEAD

Writes experiments/results/main-job.md: the seconds in all (pip's downloads, where not cached, included) and
of training as `jlong train` reports them, the loss at the first and last step (runs/tiny/metrics.jsonl), the
machine's load when it started (other work shares a CI machine's cores), and what the run printed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, invocation, machine, publish, today  # noqa: E402

TRAINED = re.compile(r"trained steps 1-(\d+) of \d+ in ([\d.,]+) s")
# Lines of the environment, not of jlong: jax's CUDA probe on a CPU machine, pip's notes on its package indexes.
NOISE = ("WARNING: All log", "I0000", "WARNING: Location")


def readme_command(clone: Path) -> str:
    """The first bash block of the clone's README, under "Two commands on a fresh machine"."""
    text = (clone / "README.md").read_text()
    section = text[text.index("## Two commands on a fresh machine"):]
    return re.search(r"```bash\n(.+?)\n```", section, re.DOTALL).group(1).strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="HEAD", help="the commit to clone and time (default: HEAD)")
    args = parser.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", args.commit], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "jlong"
        started = time.perf_counter()
        subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "--quiet", head], cwd=clone, check=True)
        command = readme_command(clone)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "XLA_FLAGS")}
        run = subprocess.run(["bash", "-c", command], cwd=clone, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        seconds = time.perf_counter() - started
        output = run.stdout.strip().replace(str(clone), ".")  # no path of this machine
        if run.returncode:
            print(output[-3000:], file=sys.stderr)
            print(f"main_job: the README's command failed (exit status {run.returncode})", file=sys.stderr)
            return 1
        losses = [json.loads(line)["loss"] for line in (clone / "runs/tiny/metrics.jsonl").read_text().splitlines()]
        jax_version = subprocess.run([str(clone / ".venv/bin/python"), "-c", "import jax; print(jax.__version__)"],
                                     capture_output=True, text=True, check=True).stdout.strip()
    steps, training = TRAINED.search(output).groups()
    shown = "\n".join(line for line in output.splitlines() if not line.startswith(NOISE))
    text = "\n".join([
        "# The README's main job, from a fresh clone (measured)",
        "",
        f"Produced by `{invocation(__file__, argv)}` at commit {head} on {today()} with jax {jax_version} on "
        f"{machine()} (cpu, 8 virtual devices: fsdp 2 x sp 4): a fresh clone of the commit, then the README's "
        f"command in it, timed; the machine's 1-minute load average was {load:.2f} when it started.",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- {seconds:.0f} s in all, from the clone (pip's downloads, where not cached, included), of which "
        f"{training} s of training, as `jlong train` reports it",
        f"- the loss {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step {steps} (runs/tiny/metrics.jsonl)",
        "",
        "What it printed (jax's and pip's notes on this machine's setup aside):",
        "",
        "```",
        shown,
        "```",
        "",
    ])
    return publish("main-job.md", text)


if __name__ == "__main__":
    sys.exit(main())
