"""Per-thread CPU time and time spent waiting for a CPU, from the kernel's scheduler accounting
(`/proc/PID/task/TID/schedstat`: ns on a CPU, ns runnable but waiting, timeslices), read
before and after a stretch of work (S1, X9a). The wait is what another thread of the machine
took from this one: on a core a forward shares with its node's poller and progress threads,
that is the disaggregated forward's loss. Threads go by their OS names (the transfer core names
its own: `tc-domain-N`, the counter poller); a process's main thread is `main`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

Snapshot = dict[str, tuple[int, int]]  # "node/thread" -> (ns on a CPU, ns waiting)


def snapshot(processes: list[tuple[str, int]]) -> Snapshot:
    """Every thread of each (name, pid) now; threads that end between two reads are missed."""
    out: Snapshot = {}
    for name, pid in processes:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                    thread = "main" if int(tid) == pid else comm.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stat:
                    run_ns, wait_ns, _ = map(int, stat.read().split())
            except (OSError, ValueError):
                continue
            run0, wait0 = out.get(f"{name}/{thread}", (0, 0))  # same-named threads add up
            out[f"{name}/{thread}"] = (run0 + run_ns, wait0 + wait_ns)
    return out


@dataclass(frozen=True, slots=True)
class ThreadTime:
    """One thread's (or same-named threads') share of each unit of work, in ms."""

    thread: str
    cpu_ms: float
    wait_ms: float


def per_unit(before: Snapshot, after: Snapshot, units: int, floor_ms: float = 0.05
             ) -> list[ThreadTime]:
    """CPU and wait per unit (a request) between two snapshots, busiest first; threads that
    used less than `floor_ms` a unit on both counts are left out."""
    rows = []
    for thread, (run_ns, wait_ns) in after.items():
        run0, wait0 = before.get(thread, (0, 0))
        cpu, wait = (run_ns - run0) / 1e6 / units, (wait_ns - wait0) / 1e6 / units
        if cpu >= floor_ms or wait >= floor_ms:
            rows.append(ThreadTime(thread, round(cpu, 3), round(wait, 3)))
    return sorted(rows, key=lambda r: -r.cpu_ms)
