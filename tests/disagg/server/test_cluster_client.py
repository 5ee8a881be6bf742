"""`ClusterClient` (`disagg.server.cluster_client`): its event dispatcher ends with it."""

from __future__ import annotations

import threading

from disagg.server.cluster_client import ClusterClient
from tests.disagg.server.app_harness import FakeRouter


def _dispatchers() -> int:
    return sum(thread.name == "front-door-events" for thread in threading.enumerate())


def test_close_ends_the_dispatcher_waiting_on_an_idle_router() -> None:
    """No event ever arrives: close() still wakes the dispatcher and it is gone on return."""
    before = _dispatchers()
    client = ClusterClient(FakeRouter())  # type: ignore[arg-type]
    assert _dispatchers() == before + 1
    client.close()
    assert _dispatchers() == before
