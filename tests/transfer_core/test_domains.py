"""An engine's domains (`transfer_core.domains`, S5): their progress threads are the engine's
callback threads, and what the engine does to every domain reaches each."""

from __future__ import annotations

import threading
from typing import Any

from transfer_core.domains import Domains
from transfer_core.engine import TransferEngine
from transfer_core.memory import EngineAddress


class _Worker:
    """Stands in for a `DomainWorker`: a thread, and a record of what reached it."""

    def __init__(self) -> None:
        self.thread = threading.Thread(target=lambda: None)
        self.calls: list[tuple[str, Any]] = []

    def call_soon(self, callback: Any) -> None:
        self.calls.append(("call_soon", callback))

    def set_eager(self, due: Any) -> None:
        self.calls.append(("set_eager", due))

    def abandon_peer(self, address: bytes) -> None:
        self.calls.append(("abandon_peer", address))

    def stop(self, drain_s: float) -> None:
        self.calls.append(("stop", drain_s))

    def close(self) -> None:
        self.calls.append(("close", None))


def _domains(n: int) -> tuple[Domains, list[_Worker]]:
    domains, workers = Domains(lambda f: f()), [_Worker() for _ in range(n)]
    for worker in workers:
        domains.add(worker)
    return domains, workers


def test_a_callback_from_another_thread_goes_to_domain_zero() -> None:
    domains, workers = _domains(2)
    ran: list[str] = []
    domains.call(lambda: ran.append("here"))
    assert not domains.on_own_thread()
    assert ran == [] and [name for name, _ in workers[0].calls] == ["call_soon"]
    assert workers[1].calls == []


def test_a_callback_on_a_progress_thread_runs_there() -> None:
    """Not handed to domain 0: domain 1's thread runs it, inline."""
    with TransferEngine("shm", num_domains=2) as engine:
        domains, seen, ran_on = engine._domains, [], []
        done = threading.Event()

        def inner() -> None:
            ran_on.append(threading.current_thread())
            done.set()

        domains[1].call_soon(lambda: (seen.append(domains.on_own_thread()),
                                      domains.call(inner)))
        assert done.wait(5)
        assert seen == [True] and ran_on == [domains[1].thread]
        assert not domains.on_own_thread()


def test_every_domain_hears_what_the_engine_does_to_all() -> None:
    domains, workers = _domains(3)
    peer = EngineAddress("shm", (b"p0", b"p1"))
    domains.set_eager(None)
    domains.abandon_peer(peer)
    domains.stop(0.5)
    domains.close()
    for worker in workers:
        assert worker.calls == [("set_eager", None), ("abandon_peer", b"p0"),
                                ("abandon_peer", b"p1"), ("stop", 0.5), ("close", None)]
    assert list(domains) == workers and len(domains) == 3 and domains[2] is workers[2]
