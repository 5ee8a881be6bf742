"""A `TransferEngine`'s domains: one `DomainWorker` (endpoint and progress thread) per NIC (S5,
S6a), and what the engine does to all of them at once.

The progress threads are the engine's callback threads: a callback that finishes on one runs
there at once, any other is handed to domain 0's thread (`call`), and an engine call that
would wait on its own callback thread is refused (`on_own_thread`). Due writes (`expect_soon`),
a peer given up and closing reach every domain.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

from transfer_core.completion import OnDone
from transfer_core.domain_worker import DomainWorker
from transfer_core.imm_counter import Due
from transfer_core.memory import EngineAddress
from transfer_core.pyfabric import Stats


class Domains(Sequence[DomainWorker]):
    """The workers in domain order, as each opens (`add`); the engine's other collaborators
    (router, warm-up, registrations) share this sequence. `guard` runs a callback on a progress
    thread, reporting what it raises to the engine's owner."""

    def __init__(self, guard: Callable[[OnDone], None]) -> None:
        self._guard = guard
        self._workers: list[DomainWorker] = []
        self._threads: frozenset[threading.Thread] = frozenset()

    def add(self, worker: DomainWorker) -> None:
        self._workers.append(worker)
        self._threads = self._threads | {worker.thread}

    def __getitem__(self, index: int) -> DomainWorker:
        return self._workers[index]

    def __len__(self) -> int:
        return len(self._workers)

    def __iter__(self) -> Iterator[DomainWorker]:
        return iter(self._workers)

    def on_own_thread(self) -> bool:
        """Whether the calling thread is one of the domains' progress threads."""
        return threading.current_thread() in self._threads

    def call(self, callback: OnDone) -> None:
        """Run `callback` (through the guard) here on a progress thread, else on domain 0's."""
        if self.on_own_thread():
            self._guard(callback)
        else:
            self._workers[0].call_soon(callback)

    def set_eager(self, due: Due) -> None:
        """Writes are due (`expect_soon`), how soon, or no longer: every domain follows."""
        for worker in self._workers:
            worker.set_eager(due)

    def abandon_peer(self, peer: EngineAddress) -> None:
        """Every domain gives up its writes to each of `peer`'s domains."""
        for worker in self._workers:
            for address in peer.domains:
                worker.abandon_peer(address)

    def stats(self) -> list[Stats]:
        return [worker.stats() for worker in self._workers]

    def stop(self, drain_s: float) -> None:
        """Let each domain's queued ops finish (up to `drain_s`) and fail the rest."""
        for worker in self._workers:
            worker.stop(drain_s)

    def close(self) -> None:
        """Close every domain's thread and endpoint."""
        for worker in self._workers:
            worker.close()
