"""Serving nodes pinned one per CPU core, and a watch on who else uses the CPU (S1).

Glue for `benchmarks/disagg.py`, not a library. `PinnedCluster` is `LocalCluster`
(`disagg/node/local_cluster.py`) with each node bound to its own core (what `taskset -c N`
does, applied to every thread of the process); `mode="mixed"` starts the single-node baseline
(`num_mixed` engines behind the same router protocol) instead of a prefiller and a decoder.
`wait_for_quiet` and `CpuMeter` read /proc so a result can say whether other work shared the
cores while it was measured.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from typing import Literal

from disagg.errors import ConfigError
from disagg.node.cluster_config import ClusterConfig  # noqa: E402
from disagg.node.local_cluster import LocalCluster
from disagg.node.node_config import NodeConfig

Mode = Literal["mixed", "disagg"]


def pin_process(pid: int, core: int) -> None:
    """Bind every thread of `pid` to `core` (threads started later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except ProcessLookupError:
            continue  # that thread ended between the listing and the call


def process_cores(pid: int) -> list[int]:
    """The cores any thread of `pid` may run on (to record what the pinning achieved)."""
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cores |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            continue
    return sorted(cores)


class PinnedCluster(LocalCluster):
    """`mode="disagg"`: one prefiller and one decoder; `mode="mixed"`: `len(cores)` single-node
    engines. Node i runs on `cores[i]`; the router connects to `decoder_addresses` either way."""

    def __init__(self, config: ClusterConfig, mode: Mode, cores: list[int]) -> None:
        if mode == "mixed":
            config = replace(config, num_mixed=len(cores))
        super().__init__(config)
        available = os.sched_getaffinity(0)
        if not set(cores) <= available or len(set(cores)) != len(cores):
            raise ConfigError(f"cores {cores}: need distinct cores among {sorted(available)}")
        if mode == "disagg" and (len(cores) != 2 or config.num_decoders != 1):
            raise ConfigError("disagg mode runs one prefiller and one decoder on two cores")
        self.mode = mode
        self.cores = cores
        self.node_cores: dict[str, int] = {}
        self._next_core = 0

    def __enter__(self) -> PinnedCluster:
        super().__enter__()
        # Pin again now that every thread exists: covers any thread that raced the first pin.
        for process, core in zip(self.processes, self.node_cores.values(), strict=True):
            pin_process(process.pid, core)
        return self

    def _spawn(self, config: NodeConfig) -> subprocess.Popen[str]:
        process = super()._spawn(config)
        core = self.cores[self._next_core]
        self._next_core += 1
        # Popen returns once the child has exec'd, before Python has started its threads.
        pin_process(process.pid, core)
        self.node_cores[config.node_id] = core
        return process

    def affinity(self) -> dict[str, list[int]]:
        """Node name -> the cores its threads may use, read back from the kernel."""
        return {name: process_cores(process.pid)
                for name, process in zip(self.node_cores, self.processes, strict=True)}


def _cpu_jiffies() -> tuple[int, int]:
    """(all jiffies, busy jiffies) summed over every CPU, from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(x) for x in stat.readline().split()[1:9]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values), sum(values) - idle


def _process_jiffies(pid: int) -> int:
    """utime + stime of `pid` (all its threads), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
    except FileNotFoundError:
        return 0
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


@dataclass(frozen=True, slots=True)
class QuietCheck:
    """Result of `wait_for_quiet`: whether the machine got quiet, and after how long."""

    quiet: bool
    waited_s: float
    others: float  # share of all CPU time used by other processes in the last window
    ours: float  # ... and by the excluded (our own, idle) processes


def wait_for_quiet(pids: list[int], max_wait_s: float = 30.0, busy_limit: float = 0.10,
                   window_s: float = 2.0) -> QuietCheck:
    """Wait until, over a `window_s` window, processes other than `pids` kept under
    `busy_limit` of the machine's CPU busy; give up after `max_wait_s`. Our own idle nodes
    are left out of the count: they are part of what is measured, and they are never idle
    enough (fabric progress threads nap in 100 µs steps)."""
    start = time.monotonic()
    while True:
        meter = CpuMeter(pids)
        time.sleep(window_s)
        shares = meter.read()
        waited = time.monotonic() - start
        if shares["others"] < busy_limit or waited >= max_wait_s:
            return QuietCheck(shares["others"] < busy_limit, waited, shares["others"],
                              shares["ours"])


class CpuMeter:
    """CPU used between `__init__` and `read()`: by the whole machine, by `pids`, by others."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self._total, self._busy = _cpu_jiffies()
        self._ours = {pid: _process_jiffies(pid) for pid in pids}

    def read(self) -> dict[str, float]:
        """Shares of all CPU time (1.0 = every core busy the whole time)."""
        total, busy = _cpu_jiffies()
        elapsed = max(total - self._total, 1)
        ours = sum(max(0, _process_jiffies(pid) - start) for pid, start in self._ours.items())
        busy_share = (busy - self._busy) / elapsed
        ours_share = ours / elapsed
        return {"busy": busy_share, "ours": ours_share,
                "others": max(0.0, busy_share - ours_share)}


class CpuSampler:
    """A thread that records, every `interval_s`, the share of the machine's CPU used by
    processes other than `pids`: `(start, end, share)` with `time.time()` bounds, so latency
    samples can be matched with the moments other work shared the cores."""

    def __init__(self, pids: list[int], interval_s: float = 0.5) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start, meter = time.time(), CpuMeter(self.pids)
            self._stop.wait(self.interval_s)
            self.samples.append((start, time.time(), meter.read()["others"]))

    def stop(self) -> list[tuple[float, float, float]]:
        """Stop sampling; returns the samples."""
        self._stop.set()
        self._thread.join()
        return self.samples
