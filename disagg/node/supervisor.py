"""Restarting the nodes of a local cluster that die (X5e): the policy, not the mechanism.

One watcher thread per node waits for its process to end; unless the cluster is stopping, it
waits (`Backoff`: doubling from `RESTART_FIRST_S` up to `RESTART_MAX_S`) and asks the cluster
to start the node again (`Supervised.restart`, which starts it at its first control and metrics
addresses, so the router's and the decoders' reconnection, X4d, takes it back). A node that
keeps dying waits longer each time; one that then ran `STABLE_S` starts again from the first
wait. A TP node whose rank died exits by itself (S3c), so it is restarted like any other.
Threads per node, not one for all: a node that takes a minute to load must not delay the
restart of another. What counts as a restart: every start after the first, failed or not.
"""

from __future__ import annotations

import enum
import logging
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from disagg.control.backoff import Backoff
from disagg.errors import DisaggError
from disagg.utils.forked_process import ChildProcess

logger = logging.getLogger(__name__)
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 60.0  # a node up this long since its restart is healthy: its next wait is the first
POLL_S = 0.2  # how often a watcher looks at its process (and at the stop flag)


class Supervised(Protocol):
    """What the supervisor needs of a cluster (`LocalCluster`)."""

    def process_of(self, name: str) -> ChildProcess:
        """The node's current process."""
        ...

    def restart(self, name: str) -> bool:
        """Start the node again where it was; False (nothing started) once stopping. Raises
        `DisaggError` when the new process did not start."""
        ...

    @property
    def stopping(self) -> bool:
        """Whether the cluster is stopping: nothing is restarted then."""
        ...


class NodeWatch(enum.Enum):
    """Where a supervised node stands."""

    RUNNING = "running"
    WAITING = "waiting"  # it died: the backoff wait before its restart
    STARTING = "starting"  # restarted, not yet ready
    STOPPED = "stopped"  # the supervisor stopped watching it


@dataclass
class NodeRecord:
    """One node's supervision: its state, restarts so far, last exit code, next wait."""

    name: str
    state: NodeWatch = NodeWatch.RUNNING
    restarts: int = 0
    last_exit: int | None = None
    backoff: Backoff = field(default_factory=lambda: Backoff(RESTART_FIRST_S, RESTART_MAX_S))
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Watches every named node of `cluster` from its own thread and restarts it when it dies,
    until `stop()` or the cluster stops."""

    def __init__(self, cluster: Supervised, names: list[str], first_s: float = RESTART_FIRST_S,
                 max_s: float = RESTART_MAX_S, stable_s: float = STABLE_S) -> None:
        self._cluster = cluster
        self._first_s, self._max_s, self._stable_s = first_s, max_s, stable_s
        self.records = {name: NodeRecord(name, backoff=self._new_backoff()) for name in names}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(record,), daemon=True,
                                          name=f"supervise-{name}")
                         for name, record in self.records.items()]

    def start(self) -> Supervisor:
        """Start watching."""
        for thread in self._threads:
            thread.start()
        return self

    def restarts(self, name: str) -> int:
        """How many times `name` was started again."""
        return self.records[name].restarts

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop watching; waits for the watchers (a restart under way ends when the cluster
        ends its process)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))

    def _new_backoff(self) -> Backoff:
        return Backoff(self._first_s, self._max_s)

    def _done(self) -> bool:
        return self._stop.is_set() or self._cluster.stopping

    def _watch(self, record: NodeRecord) -> None:
        try:
            while not self._done():
                process = self._cluster.process_of(record.name)
                try:
                    process.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    continue
                if self._done():
                    return  # its exit is the cluster's stop, not a death
                self._restart(record, process.returncode)
        finally:
            record.state = NodeWatch.STOPPED

    def _restart(self, record: NodeRecord, code: int) -> None:
        """The node died with exit code `code`: wait its backoff, then start it again."""
        record.last_exit = code
        if time.monotonic() - record.started_at >= self._stable_s:
            record.backoff = self._new_backoff()  # it had recovered: start from the first wait
        wait = record.backoff.next()
        record.state = NodeWatch.WAITING
        logger.warning("%s exited (code %s); restarting it in %g s", record.name, code, wait)
        if self._stop.wait(wait) or self._cluster.stopping:
            return
        record.state = NodeWatch.STARTING
        record.started_at = time.monotonic()
        try:
            started = self._cluster.restart(record.name)
        except DisaggError as error:
            if self._cluster.stopping:
                return  # stop() ended it while it started: not a failed start
            # The new process is dead too (the cluster ends one that did not start): the
            # watch loop sees it and waits the next, doubled, wait.
            record.restarts += 1
            logger.warning("%s did not start again: %s", record.name, error)
            return
        if started:
            record.restarts += 1
            record.state = NodeWatch.RUNNING
            logger.warning("%s restarted (restart %d)", record.name, record.restarts)
