"""What occupies the device at the peak of a training step: XLA:GPU's own
buffer assignment, read back from a dump of the compile that `jlong plan`
runs (deviceless; nothing is allocated).

    python experiments/peak_buffers.py CONFIG [--target h100] [--min-gib 0.5] [key=value ...]

XLA dumps the step's buffer assignment (each value's size and offset in the
temporary allocation) and the live ranges of those values in the scheduled
program. This script sums, at each point of the schedule, the bytes of the
values live there, and lists the ones live at the fullest point: the
buffers any cut of temporaries has to remove. Writes
experiments/results/peak-buffers-<config name>.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jlong
from common import GIB, add_target_argument, invocation, markdown_table, plan, planning_target, provenance, publish

_DUMP = tempfile.mkdtemp(prefix="jlong-xla-dump-")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_dump_to={_DUMP} --xla_dump_hlo_module_re=.*step.* --xla_dump_hlo_pass_re=^$"
)  # read when jax starts its backends, in the first plan

_VALUE = re.compile(r" value: <\d+ ([^\s{]+)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_LIVE_RANGE = re.compile(r"\s+(\S+):(\d+)-(\d+)$")


def temporary_values(buffer_assignment: str) -> list[tuple[str, int, int, str]]:
    """(value, bytes, offset, shape) of every value in the device's temporary allocation."""
    values, in_temporaries = [], False
    for line in buffer_assignment.splitlines():
        if line.startswith("allocation"):
            # Other memory spaces (host memory) carry a color; the device's does not.
            in_temporaries = "preallocated-temp" in line and "color" not in line
        elif in_temporaries and (match := _VALUE.match(line)):
            name, index, size, offset, shape = match.groups()
            values.append((name + (index or "{}"), int(size), int(offset), shape))
    return values


def live_ranges(live_range_dump: str) -> dict[str, tuple[int, int]]:
    ranges, in_ranges = {}, False
    for line in live_range_dump.splitlines():
        in_ranges = in_ranges or "BufferLiveRange" in line
        if in_ranges and (match := _LIVE_RANGE.match(line)):
            ranges[match.group(1)] = (int(match.group(2)), int(match.group(3)))
    return ranges


def live_at_peak(values, ranges) -> tuple[int, list[tuple[str, int, str]]]:
    """(live bytes at the fullest point, the values live there, largest first).
    Values sharing an offset at the same time (aliases) count once."""
    end = max(stop for _, stop in ranges.values()) + 1
    live = [dict() for _ in range(end)]  # time -> {offset: bytes}
    for name, size, offset, _ in values:
        if name in ranges:
            start, stop = ranges[name]
            for t in range(start, stop + 1):
                live[t][offset] = max(live[t].get(offset, 0), size)
    peak = max(range(end), key=lambda t: sum(live[t].values()))
    at_peak, seen = [], set()
    for name, size, offset, shape in sorted(values, key=lambda v: -v[1]):
        start, stop = ranges.get(name, (end, end))
        if start <= peak <= stop and offset not in seen:
            seen.add(offset)
            at_peak.append((name, size, shape))
    return sum(live[peak].values()), at_peak


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    add_target_argument(parser)
    parser.add_argument("--min-gib", type=float, default=0.5, help="list buffers at least this large")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    target = planning_target(args.target)
    result = plan(jlong.load_config(args.config, args.overrides), target).memory
    dump = Path(_DUMP)
    assignment = next(dump.glob("**/*step*buffer-assignment.txt")).read_text()
    ranges = live_ranges(next(dump.glob("**/*step*live-range.txt")).read_text())
    peak_bytes, buffers = live_at_peak(temporary_values(assignment), ranges)
    rows = [[name, f"{size / GIB:.2f}", f"`{shape}`"] for name, size, shape in buffers if size >= args.min_gib * GIB]
    name = Path(args.config).stem
    text = "\n\n".join([
        f"# Buffers live at the peak of the training step: {name}",
        provenance(invocation(__file__), target.compiler()),
        f"Plan: {result.temporaries / GIB:.2f} GiB of temporaries, {result.device_total / GIB:.2f} GiB per "
        f"device in all. Live at the fullest point of the schedule: {peak_bytes / GIB:.2f} GiB of the "
        f"temporary allocation (the allocation itself also holds fragmentation and buffers that outlive "
        f"the step's loops). Buffers of at least {args.min_gib} GiB:",
        markdown_table(["HLO value", "GiB", "shape"], rows),
    ]) + "\n"
    shutil.rmtree(dump)
    return publish(f"peak-buffers-{name}.md", text)


if __name__ == "__main__":
    sys.exit(main())
