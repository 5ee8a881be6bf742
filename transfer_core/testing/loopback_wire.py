"""The wire of the in-process loopback engine: a registry of endpoints and a delivery queue
(S5 test double; the counts it delivers are S4c's).

`LoopbackFabric` stands in for the network: it maps endpoint addresses to the engine (and
domain) that owns them, so a write finds its target bytes from a descriptor alone, exactly
as a peer would. `DeliveryQueue` stands in for a progress thread: jobs run in order on one
thread of the owning engine, or inline in the caller for single-threaded tests; `hold()`
parks the jobs that would move data so a test can look at "writes in flight".
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from transfer_core.errors import PeerError, TransferError
from transfer_core.memory import EngineAddress

Job = Callable[[], None]
Cancel = Callable[[TransferError], None]


class LoopbackFabric:
    """Endpoint address -> (engine, domain index). Thread-safe; addresses are never reused."""

    _serials = itertools.count()

    def __init__(self) -> None:
        self.serial = next(self._serials)
        self._lock = threading.Lock()
        self._endpoints: dict[bytes, tuple[Any, int]] = {}
        self._engine_ids = itertools.count()

    def attach(self, engine: Any, num_domains: int) -> tuple[bytes, ...]:
        """Give `engine` one fresh address per domain."""
        n = next(self._engine_ids)
        addresses = tuple(f"loopback://{self.serial}/{n}/{d}".encode() for d in range(num_domains))
        with self._lock:
            for d, address in enumerate(addresses):
                self._endpoints[address] = (engine, d)
        return addresses

    def detach(self, addresses: tuple[bytes, ...]) -> None:
        """The engine closed: writes to these addresses fail as to an unreachable peer."""
        with self._lock:
            for address in addresses:
                self._endpoints.pop(address, None)

    def lookup(self, address: bytes) -> tuple[Any, int] | None:
        with self._lock:
            return self._endpoints.get(address)

    def check_reachable(self, provider: str, peer_address: bytes, num_domains: int) -> None:
        """What `connect` can check here: the address parses, is ours, and each domain of a
        `num_domains` engine finds the peer endpoint it would write to."""
        peer = EngineAddress.from_bytes(peer_address)
        if peer.provider != provider:
            raise ValueError(
                f"peer address is on provider {peer.provider!r}, this engine uses {provider!r}"
            )
        for d in range(num_domains):
            address = peer.domains[d % len(peer.domains)]
            if self.lookup(address) is None:
                raise PeerError(
                    f"warming up the connection to peer endpoint {address!r}: "
                    "no loopback engine there"
                )

    def engines(self) -> list[Any]:
        with self._lock:
            return list({id(e): e for e, _ in self._endpoints.values()}.values())

    def quiesce(self, timeout_s: float = 10.0) -> bool:
        """Wait until no engine on this fabric has a delivery queued or running (held writes
        excepted); a delivery can queue work at another engine, hence the repeated sweep."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for engine in self.engines():
                if not engine.delivery.wait_idle(max(0.0, deadline - time.monotonic())):
                    return False
            if all(engine.delivery.idle_now() for engine in self.engines()):
                return True
        return False


_default: LoopbackFabric | None = None
_default_lock = threading.Lock()


def default_fabric() -> LoopbackFabric:
    """The process-wide fabric engines join when given none."""
    global _default
    with _default_lock:
        if _default is None:
            _default = LoopbackFabric()
        return _default


class DeliveryQueue:
    """Runs jobs in submission order on its own thread, or inline when `inline`.

    `run(job)` is the engine's guard (it keeps a callback's exception for the owner). Jobs put
    with `holdable=True` (data movement) are parked between `hold()` and `release()`."""

    def __init__(self, name: str, inline: bool, run: Callable[[Job], None]) -> None:
        self._run = run
        self._inline = inline
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Job, Cancel | None]] = deque()
        self._held: list[tuple[Job, Cancel | None]] = []
        self._holding = False
        self._busy = False
        self._stopped = False
        self.thread: threading.Thread | None = None
        if not inline:
            self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
            self.thread.start()

    def put(self, job: Job, cancel: Cancel | None = None, holdable: bool = False) -> None:
        with self._cond:
            if not self._stopped:
                if holdable and self._holding:
                    self._held.append((job, cancel))
                    return
                if not self._inline:
                    self._jobs.append((job, cancel))
                    self._cond.notify_all()
                    return
        if self._stopped:  # raced with close(): the job will never run
            if cancel is not None:
                cancel(TransferError("engine closed before the operation finished"))
            return
        self._run(job)  # inline: now, in the caller's thread

    def hold(self) -> None:
        with self._cond:
            self._holding = True

    def release(self) -> None:
        """Stop holding; parked jobs run (inline: now, in order)."""
        with self._cond:
            self._holding = False
            held, self._held = self._held, []
            if not self._inline:
                self._jobs.extend(held)
                self._cond.notify_all()
                return
        for job, _ in held:
            self._run(job)

    def held(self) -> int:
        with self._cond:
            return len(self._held)

    def take_held(self, match: Callable[[Job], bool]) -> list[Cancel]:
        """Unpark the parked jobs `match` picks, for good: the cancels of those that have one."""
        with self._cond:
            taken = [(job, cancel) for job, cancel in self._held if match(job)]
            self._held = [entry for entry in self._held if not match(entry[0])]
        return [cancel for _, cancel in taken if cancel is not None]

    def idle_now(self) -> bool:
        with self._cond:
            return not self._jobs and not self._busy

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Until nothing is queued or running (parked jobs do not count)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._busy, timeout_s)

    def stop(self, drain_s: float) -> list[Cancel]:
        """Let queued jobs run for up to `drain_s`, stop, return the cancels of the rest."""
        self.wait_idle(drain_s)
        with self._cond:
            self._stopped = True
            left = [*self._jobs, *self._held]
            self._jobs.clear()
            self._held.clear()
            self._cond.notify_all()
        if self.thread is not None:
            self.thread.join()
        return [cancel for _, cancel in left if cancel is not None]

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._jobs or self._stopped)
                if self._stopped:
                    return
                job, _ = self._jobs.popleft()
                self._busy = True
            try:
                self._run(job)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
