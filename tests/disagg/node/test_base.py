"""The accept loop both nodes share (S2, S5): a cap on live connections, readers that
close and forget their channel however they end, and accepting that survives EMFILE and
stops only when the node closes its server socket. A stand-in node (no model, no fabric)."""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from disagg.control.address import parse_address
from disagg.control.channel import Channel
from disagg.node.base import NodeBase

pytestmark = pytest.mark.timeout(60)


class StandIn(NodeBase):
    """Just the connection handling of a node: `serve` is each connection's reader."""

    def __init__(self, serve: Callable[[Channel], None], max_connections: int = 8,
                 emfile_first: int = 0) -> None:
        self._stop = threading.Event()
        self._channels = []
        self.messenger = self.transfer = self.tracer = self.engine = SimpleNamespace(  # type: ignore[assignment]
            close=lambda: None)
        self._listen("127.0.0.1:0")
        if emfile_first:
            self._server = FlakyServer(self._server, emfile_first)  # type: ignore[assignment]
        self.accept_thread = self._start_accepting(serve, "peer", max_connections)

    def connect(self) -> socket.socket:
        return socket.create_connection(parse_address(self.address), timeout=5)


def hung_up(sock: socket.socket) -> bool:
    """Whether the node closed `sock` (EOF or reset) within its timeout."""
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


@pytest.fixture
def release() -> Iterator[threading.Event]:
    event = threading.Event()
    yield event
    event.set()


def test_connections_past_the_cap_are_closed_at_once(release: threading.Event) -> None:
    """With 3 readers busy, a 4th connection is closed at once; once one reader ends, the
    node accepts again: threads never grow past the cap."""
    served = threading.Semaphore(0)

    def serve(channel: Channel) -> None:
        served.release()
        release.wait()

    node = StandIn(serve, max_connections=3)
    busy = [node.connect() for _ in range(3)]
    for _ in busy:
        assert served.acquire(timeout=5)
    extra = node.connect()
    assert hung_up(extra)
    assert len(node._channels) == 3
    release.set()
    for sock in busy:
        assert hung_up(sock)  # each reader's channel closed as it ended
    later = node.connect()
    assert served.acquire(timeout=5)
    for sock in [*busy, extra, later]:
        sock.close()
    node.close()


def test_a_reader_that_raises_still_closes_and_forgets_its_channel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception escaping a reader (a bug, or hostile input nobody foresaw) propagates to
    the thread's excepthook, and its channel is closed and dropped all the same."""
    escaped: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))

    def serve(channel: Channel) -> None:
        raise RecursionError("what a hostile payload could do")

    node = StandIn(serve)
    with node.connect() as sock:
        assert hung_up(sock)
    deadline = time.monotonic() + 5
    while node._channels or not escaped:
        assert time.monotonic() < deadline, (node._channels, escaped)
        time.sleep(0.01)
    assert [type(error) for error in escaped] == [RecursionError]
    node.close()


class FlakyServer:
    """A listening socket whose first `failures` accepts fail with EMFILE."""

    def __init__(self, server: socket.socket, failures: int) -> None:
        self.server, self.failures = server, failures

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.server.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self.server, name)


def test_accepting_survives_emfile_and_ends_only_at_close(
        caplog: pytest.LogCaptureFixture, release: threading.Event) -> None:
    """Accept failing with EMFILE is logged once and retried; a connection is then served,
    and closing the node ends the accept loop."""
    served = threading.Event()

    def serve(channel: Channel) -> None:
        served.set()
        release.wait()

    node = StandIn(serve, emfile_first=3)
    with node.connect():
        assert served.wait(timeout=5)
    assert sum("Too many open files" in r.getMessage() for r in caplog.records) == 1
    node.close()
    node.accept_thread.join(timeout=5)
    assert not node.accept_thread.is_alive()
