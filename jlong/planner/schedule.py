"""The schedule walk: a module's computations in the order XLA scheduled
them, each launch priced by a `Pricer`, asynchronous work (collectives,
host copies) running beside the kernels from its start to its done, loops
times their trip counts, a call or conditional at its costliest branch."""

from __future__ import annotations

import collections
import dataclasses

from jlong.planner.hlo import Computation, HloModule
from jlong.planner.pricing import _NO_KERNEL, Pricer, Tally, _allocates_only


class ScheduleWalk:
    """Walks a module's computations in schedule order and prices them."""

    def __init__(self, module: HloModule, pricer: Pricer):
        self.module, self.pricer, self.eff = module, pricer, pricer.eff
        self._memo: dict[str, Tally] = {}

    def run(self, name: str) -> Tally:
        if name not in self._memo:
            self._memo[name] = self._timeline(self.module.computations[name])
        return self._memo[name]

    def _timeline(self, computation: Computation) -> Tally:
        tally = Tally()
        now = 0.0
        stream_free: dict[str, float] = collections.defaultdict(float)
        in_flight: dict[str, tuple[str, float]] = {}  # start name -> (stream, finish)
        for inst in computation.instructions:
            op = inst.opcode
            if op in _NO_KERNEL or _allocates_only(inst):
                continue
            if op.endswith("-done"):
                stream, finish = in_flight.pop(inst.operands[0], ("", now)) if inst.operands else ("", now)
                if finish > now:
                    tally.waited_s[stream] += finish - now
                    now = finish
                continue
            if op == "while":
                body, condition = (inst.attribute(key).lstrip("%") for key in ("body", "condition"))
                trips = inst.known_trip_count
                if trips is None:
                    trips = 1
                    tally.unknown_trip_loops += 1
                loop = Tally()
                loop.add(self.run(body), trips)
                loop.add(self.run(condition), trips + 1)
                now += loop.time_s
                loop.time_s = 0.0
                tally.add(loop)
                continue
            if op in ("call", "conditional"):
                branches = [self.run(name) for name in inst.called]
                slowest = max(branches, key=lambda t: t.time_s)
                now += slowest.time_s
                inner = dataclasses.replace(slowest, time_s=0.0)
                tally.add(inner)
                continue
            kind, seconds = self.pricer.price(inst, computation, tally)
            launch = self.eff.launch_us * 1e-6
            tally.launches += 1
            tally.busy_s["launch"] += launch
            now += launch
            if op.endswith("-start") and kind in ("collective", "host"):  # runs beside the kernels until its done
                start = max(now, stream_free[kind])
                stream_free[kind] = start + seconds
                in_flight[inst.name] = (kind, start + seconds)
            else:
                now += seconds
        pending = max((finish for _, finish in in_flight.values()), default=now)
        if pending > now:
            for stream, finish in in_flight.values():
                tally.waited_s[stream] += max(finish - now, 0.0)
            now = pending
        tally.time_s = now
        return tally
