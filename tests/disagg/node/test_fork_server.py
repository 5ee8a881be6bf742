"""The node fork server on its own wire (X5f): a real server process, spoken to over the
socket its client would use. Its children run a node's entry point; fed a config that is not
JSON, they stop at once with the CLI's user-error code, so no model is ever built here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from disagg.node.fork_wire import recv_record, send_record


@pytest.fixture
def server() -> Iterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    """A fork server, ready: (this end of its socket, its process)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = subprocess.Popen([sys.executable, "-m", "disagg.node.fork_server",
                                str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    ours.settimeout(60)
    record, _ = recv_record(ours)
    assert record == {"ready": process.pid}
    yield ours, process
    ours.close()
    process.wait(timeout=10)


def test_it_has_imported_the_nodes_modules_before_it_forks(
        server: tuple[socket.socket, subprocess.Popen[bytes]]) -> None:
    """What a child is spared: torch's library and the fabric's (which the node's modules
    load) are mapped in the server once it is ready."""
    _, process = server
    with open(f"/proc/{process.pid}/maps") as maps:
        mapped = maps.read()
    assert "libtorch_cpu" in mapped and "libfabric" in mapped


def test_it_holds_no_thread_pool_when_it_forks(
        server: tuple[socket.socket, subprocess.Popen[bytes]]) -> None:
    """A child inherits memory, never threads: the server's only other thread is the one
    worker numpy's OpenBLAS starts at import (which OpenBLAS rebuilds after a fork); an
    OpenMP or torch pool started before forking would leave its children's pools broken."""
    _, process = server
    assert len(os.listdir(f"/proc/{process.pid}/task")) <= 2


def test_a_start_forks_a_node_that_reads_the_pipes_it_was_sent(
        server: tuple[socket.socket, subprocess.Popen[bytes]]) -> None:
    """The child is the server's, takes the sent pipes as stdin and stderr, and its exit is
    reported with the code `serve.main()` gives a config that is not JSON (2)."""
    sock, process = server
    stdin, stdout, stderr = os.pipe(), os.pipe(), os.pipe()
    send_record(sock, {"start": "node"}, [stdin[0], stdout[1], stderr[1]])
    for fd in (stdin[0], stdout[1], stderr[1]):
        os.close(fd)
    record, _ = recv_record(sock)
    pid = record["started"]
    with open(f"/proc/{pid}/stat") as stat:
        assert int(stat.read().rsplit(")", 1)[1].split()[1]) == process.pid  # its parent
    os.write(stdin[1], b"{not json")
    os.close(stdin[1])
    assert recv_record(sock)[0] == {"exited": pid, "code": 2}
    with os.fdopen(stderr[0]) as err:
        assert "error: node config" in err.read()
    os.close(stdout[0])


def test_a_start_without_its_three_pipes_is_refused(
        server: tuple[socket.socket, subprocess.Popen[bytes]]) -> None:
    sock, _ = server
    read, write = os.pipe()
    send_record(sock, {"start": "node"}, [read])
    os.close(read)
    os.close(write)
    record, _ = recv_record(sock)
    assert "3 fds" in record["failed"]


def test_its_children_are_ended_when_its_client_closes(
        server: tuple[socket.socket, subprocess.Popen[bytes]]) -> None:
    """The parent-death signal: a child still waiting on its stdin gets SIGTERM."""
    sock, process = server
    ends = [os.pipe() for _ in range(3)]
    send_record(sock, {"start": "node"}, [ends[0][0], ends[1][1], ends[2][1]])
    pid = recv_record(sock)[0]["started"]
    sock.shutdown(socket.SHUT_RDWR)
    assert process.wait(timeout=10) == 0
    assert ended_within(pid, 10.0)
    for read, write in ends:
        os.close(read)
        os.close(write)


def ended_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` (no child of ours) is gone or a zombie within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
