"""Hostile clients against real node processes with the cluster secret (S2, S5).

A prefiller and a decoder run as processes over tcp on loopback; the attacks come from raw
sockets and from channels of this process: a captured signed Shutdown replayed, a huge frame
before authentication, deeply nested JSON, silent and 1 byte/s connections, routers that come
and go, and a node run out of file descriptors. After each, both nodes still serve, and at the
end both shut down with their leak checks clean.
"""

from __future__ import annotations

import contextlib
import os
import queue
import resource
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from disagg.control import channel as channel_module
from disagg.control.address import listen, parse_address
from disagg.control.channel import HANDSHAKE_TIMEOUT_S, Channel
from disagg.control.framing import HEADER, MAGIC, PROTOCOL_VERSION, TAGGED, Message
from disagg.control.messages import Heartbeat, Reject, RequestEvent, Shutdown, Status, Submit
from disagg.control.secret import SECRET_ENV
from disagg.errors import PeerClosedError
from disagg.kv_transfer.messages import Hello
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router

pytestmark = [pytest.mark.fabric, pytest.mark.slow]  # two node processes, timeouts waited out

SECRET = "hostile-test-secret"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """One prefiller and one decoder sharing a secret (this process holds it too)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET_ENV, SECRET)
        with LocalCluster(ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4,
                                                     num_pages=128, chunk_size=32)) as started:
            yield started
        assert started.exit_codes() == [0, 0], started.logs  # both leak checks passed


def pid(cluster: LocalCluster, name: str) -> int:
    return cluster.processes[cluster.names.index(name)].pid


def open_fds(cluster: LocalCluster, name: str) -> int:
    return len(os.listdir(f"/proc/{pid(cluster, name)}/fd"))


def assert_serves(cluster: LocalCluster) -> None:
    """Both nodes alive, and a request through a new router connection finishes."""
    assert cluster.exit_codes() == [None, None], cluster.logs
    router = Router([cluster.decoder_addresses[0]])
    try:
        router.route(Submit("probe", [1, 2, 3, 4, 5], 3))
        while not (event := router.events.get(timeout=30)).state.is_terminal():
            pass
        assert event.state.value == "finished_length", event
    finally:
        router.close()


def recv_within(channel: Channel, timeout_s: float) -> Message | Exception | None:
    """The next message or the error recv raised; None if nothing came in time."""
    results: queue.Queue[Message | Exception] = queue.Queue()

    def read() -> None:
        try:
            results.put(channel.recv())
        except Exception as error:  # noqa: BLE001 - handed to the test to judge
            results.put(error)

    threading.Thread(target=read, daemon=True).start()
    try:
        return results.get(timeout=timeout_s)
    except queue.Empty:
        return None


def closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the node hung up on `sock` (EOF or reset) within `timeout_s`."""
    sock.settimeout(timeout_s)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if not sock.recv(1 << 16):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


class Tap:
    """A socket that records every byte its channel reads: the eavesdropper's capture."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.received = sock, bytearray()

    def recv(self, nbytes: int, *flags: int) -> bytes:
        data = self.sock.recv(nbytes, *flags)
        self.received += data
        return data

    def recv_into(self, buffer: memoryview, nbytes: int = 0, *flags: int) -> int:
        count = self.sock.recv_into(buffer, nbytes, *flags)
        self.received += buffer[:count]
        return count

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - the socket's own attributes
        return getattr(self.sock, name)


def captured_shutdown() -> bytes:
    """The bytes an operator's signed Shutdown puts on the wire, captured at a stand-in."""
    server = listen("127.0.0.1:0")
    captures: list[bytes] = []

    def stand_in() -> None:
        tap = Tap(server.accept()[0])
        channel = Channel(tap, "operator")  # type: ignore[arg-type]
        assert isinstance(channel.recv(), Shutdown)
        captures.append(bytes(tap.received))
        channel.close()

    thread = threading.Thread(target=stand_in)
    thread.start()
    operator = Channel.connect("%s:%d" % server.getsockname()[:2])
    operator.send(Shutdown())
    thread.join(timeout=10)
    operator.close()
    server.close()
    return captures[0]


def test_a_replayed_signed_shutdown_stops_no_node(cluster: LocalCluster) -> None:
    """A signed Shutdown captured on the wire, replayed at each node, fails authentication
    there: the nodes keep running."""
    frames = captured_shutdown()
    for address in (cluster.prefiller_address, cluster.decoder_addresses[0]):
        with socket.create_connection(parse_address(address), timeout=5) as attacker:
            attacker.sendall(frames)
            assert closed_within(attacker, 10)  # refused, not obeyed
    time.sleep(0.5)  # an obeyed Shutdown would have ended a node by now
    assert_serves(cluster)


def test_routers_and_decoders_that_leave_leave_no_descriptor(cluster: LocalCluster) -> None:
    """Fifty connections opened and dropped at each node: its open descriptors come back to
    where they were (every reader closes its channel, whatever ends it)."""
    assert_serves(cluster)
    names = {"decode-0": cluster.decoder_addresses[0], "prefill-0": cluster.prefiller_address}
    before = {name: open_fds(cluster, name) for name in names}
    for _ in range(50):
        for address in names.values():
            Channel.connect(address).close()
        router = Router([cluster.decoder_addresses[0]])
        router.close()
    deadline = time.monotonic() + 10
    while any(open_fds(cluster, name) > before[name] + 3 for name in names):
        assert time.monotonic() < deadline, {name: (before[name], open_fds(cluster, name))
                                             for name in names}
        time.sleep(0.1)


def nested_frame(message: type[Message], depth: int = 20_000) -> bytes:
    body = b"[" * depth + b"]" * depth
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, message.TYPE | TAGGED, len(body)) + body


@pytest.mark.parametrize(("node", "first"), [("decode-0", Submit), ("prefill-0", Hello)])
def test_deeply_nested_json_is_refused_naming_it(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, node: str,
        first: type[Message]) -> None:
    """A signed frame of deeply nested JSON (a peer with the secret, gone wrong) is answered
    with a Reject naming it; the node serves on. The frame was whole and authentic, so a
    router's connection goes on (its other requests are not cut); a decoder that sends it
    instead of its Hello is hung up on."""
    decoder = node == "decode-0"
    address = (cluster.decoder_addresses if decoder else [cluster.prefiller_address])[0]
    channel = Channel.connect(address)
    if decoder:
        assert recv_within(channel, 10) == Status(True)  # what a router hears first
    monkeypatch.setattr(channel_module, "encode", lambda *_, **__: nested_frame(first))
    channel.send(first)  # type: ignore[arg-type]  # the patched encode ignores it
    monkeypatch.undo()
    reply = recv_within(channel, 10)
    assert isinstance(reply, Reject) and "payload is not JSON" in reply.reason, reply
    if decoder:
        channel.send(Submit("after", [1, 2, 3], 2))
        while isinstance(event := recv_within(channel, 30), RequestEvent | Heartbeat):
            if isinstance(event, RequestEvent) and event.state.is_terminal():
                break  # (heartbeats come every second: passed over)
        assert isinstance(event, RequestEvent) and event.state.value == "finished_length"
    else:
        assert isinstance(recv_within(channel, 10), PeerClosedError)
    channel.close()
    assert_serves(cluster)


def stranger(address: str) -> socket.socket:
    """A raw connection that sends the preface (a nonce) as a node would, and nothing else."""
    sock = socket.create_connection(parse_address(address), timeout=5)
    sock.sendall(channel_module.PREFACE.pack(channel_module.PREFACE_MAGIC, PROTOCOL_VERSION,
                                             os.urandom(16)))
    return sock


def test_a_huge_frame_before_authentication_is_refused_from_its_header(
        cluster: LocalCluster) -> None:
    """A stranger announcing a 60 MiB frame is hung up on at once, its body never read."""
    for address in (cluster.prefiller_address, cluster.decoder_addresses[0]):
        with stranger(address) as sock:
            sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, Submit.TYPE | TAGGED, 60 << 20))
            assert closed_within(sock, HANDSHAKE_TIMEOUT_S / 2)


def test_silent_and_slow_connections_are_cut(cluster: LocalCluster) -> None:
    """Connections that never finish their handshake (silent, or 1 byte every half second)
    are closed after the handshake timeout, so they cannot pin the node's threads."""
    sockets = []
    for address in (cluster.prefiller_address, cluster.decoder_addresses[0]):
        sockets += [socket.create_connection(parse_address(address), timeout=5), stranger(address)]
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        header = HEADER.pack(MAGIC, PROTOCOL_VERSION, Submit.TYPE | TAGGED, 100)
        with contextlib.suppress(OSError):
            for byte in header:
                if stop.wait(0.5):
                    return
                sock.sendall(bytes([byte]))

    for sock in sockets[1::2]:
        threading.Thread(target=trickle, args=(sock,), daemon=True).start()
    try:
        for sock in sockets:
            assert closed_within(sock, HANDSHAKE_TIMEOUT_S + 5)
    finally:
        stop.set()
        for sock in sockets:
            sock.close()
    assert_serves(cluster)


def test_accepting_survives_running_out_of_descriptors(cluster: LocalCluster) -> None:
    """With its descriptor limit lowered, each node's accept fails with EMFILE; it logs,
    backs off and keeps accepting, so once descriptors are free again it serves."""
    limits = {}
    for name in ("prefill-0", "decode-0"):
        highest = max(int(fd) for fd in os.listdir(f"/proc/{pid(cluster, name)}/fd"))
        limits[name] = resource.prlimit(pid(cluster, name), resource.RLIMIT_NOFILE)
        resource.prlimit(pid(cluster, name), resource.RLIMIT_NOFILE,
                         (highest + 4, limits[name][1]))
    sockets = []
    try:
        for address in (cluster.prefiller_address, cluster.decoder_addresses[0]):
            sockets += [socket.create_connection(parse_address(address), timeout=5)
                        for _ in range(40)]
        deadline = time.monotonic() + 10
        while not all(any("connections failed" in line for line in cluster.logs[name])
                      for name in limits):
            assert time.monotonic() < deadline, "no node ran out of descriptors"
            time.sleep(0.1)
    finally:
        for sock in sockets:
            sock.close()
        for name, limit in limits.items():
            resource.prlimit(pid(cluster, name), resource.RLIMIT_NOFILE, limit)
    assert_serves(cluster)
    prefiller = Channel.connect(cluster.prefiller_address)  # its accept loop lives too
    prefiller.send(Hello("probe", "m", "float32", 4, "NHD", 2, 4, 8, b"", [], b"", 1))
    reply = recv_within(prefiller, 10)
    assert isinstance(reply, Reject) and "model" in reply.reason, reply
    prefiller.close()
