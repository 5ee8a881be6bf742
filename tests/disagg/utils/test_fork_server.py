"""The fork server on its own wire (X5f): a real server process that preloads a node's entry
point, spoken to over the socket its client would use. Its children run that entry point; fed
a config that is not JSON they stop at once with the CLI's user-error code, so no model is
ever built here."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from disagg.utils.fork_server import _drain
from disagg.utils.fork_wire import recv_record, send_record
from tests.process_stat import ended_within, parent_of

ENTRY = "disagg.node.serve"
Server = tuple[socket.socket, subprocess.Popen[bytes]]


def launch() -> Iterator[Server]:
    """A fork server preloading `ENTRY`, ready: (this end of its socket, its process)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = subprocess.Popen([sys.executable, "-m", "disagg.utils.fork_server",
                                str(theirs.fileno()), ENTRY], pass_fds=[theirs.fileno()])
    theirs.close()
    ours.settimeout(60)
    record, _ = recv_record(ours)
    assert record == {"ready": process.pid, "modules": [ENTRY]}
    yield ours, process
    ours.close()
    process.wait(timeout=10)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One server for the tests that leave it serving (each start costs an import of torch)."""
    yield from launch()


@pytest.fixture
def own_server() -> Iterator[Server]:
    """A server of the test's own, for a test that ends it."""
    yield from launch()


def start(sock: socket.socket, module: str = ENTRY) -> tuple[dict, list[int]]:
    """Ask for a child with three fresh pipes: (the reply, our ends: its stdin's to write,
    its stdout's and stderr's to read)."""
    pipes = [os.pipe() for _ in range(3)]
    send_record(sock, {"start": module}, [pipes[0][0], pipes[1][1], pipes[2][1]])
    for fd in (pipes[0][0], pipes[1][1], pipes[2][1]):
        os.close(fd)
    return recv_record(sock)[0], [pipes[0][1], pipes[1][0], pipes[2][0]]



def test_it_has_imported_its_modules_before_it_forks(server: Server) -> None:
    """What a child is spared: torch's library and the fabric's (which the node's modules
    load) are mapped in the server once it is ready."""
    _, process = server
    with open(f"/proc/{process.pid}/maps") as maps:
        mapped = maps.read()
    assert "libtorch_cpu" in mapped and "libfabric" in mapped


def test_it_holds_no_thread_pool_when_it_forks(server: Server) -> None:
    """A child inherits memory, never threads: the server's only other thread is the one
    worker numpy's OpenBLAS starts at import (which OpenBLAS rebuilds after a fork); an
    OpenMP or torch pool started before forking would leave its children's pools broken."""
    _, process = server
    assert len(os.listdir(f"/proc/{process.pid}/task")) <= 2


def test_a_child_runs_the_module_on_the_pipes_it_was_sent(server: Server) -> None:
    """The child is the server's, takes the sent pipes as stdin and stderr, and its exit is
    reported with the code the node's `main()` gives a config that is not JSON (2)."""
    sock, process = server
    reply, (stdin, stdout, stderr) = start(sock)
    pid = reply["started"]
    assert parent_of(pid) == process.pid
    os.write(stdin, b"{not json")
    os.close(stdin)
    assert recv_record(sock)[0] == {"exited": pid, "code": 2}
    with os.fdopen(stderr) as err:
        assert "error: node config" in err.read()
    os.close(stdout)


def test_a_module_it_did_not_preload_is_refused(server: Server) -> None:
    sock, _ = server
    reply, ends = start(sock, "disagg.parallel.rank_worker")
    assert "not a module this server preloaded" in reply["failed"]
    for fd in ends:
        os.close(fd)


def test_a_start_without_its_three_fds_is_refused(server: Server) -> None:
    sock, _ = server
    read, write = os.pipe()
    send_record(sock, {"start": ENTRY}, [read])
    os.close(read)
    os.close(write)
    assert "3 fds" in recv_record(sock)[0]["failed"]


def test_its_children_end_when_its_first_client_closes(own_server: Server) -> None:
    """The parent-death signal: a child still waiting on its stdin gets SIGTERM."""
    sock, process = own_server
    reply, ends = start(sock)
    sock.shutdown(socket.SHUT_RDWR)
    assert process.wait(timeout=10) == 0
    assert ended_within(reply["started"], 10.0)  # its stdin still open: not by itself
    for fd in ends:
        os.close(fd)



def test_the_wake_up_pipe_drains_whatever_piled_up() -> None:
    """Signals caught while the server was busy: a multiple of the read size too, where a
    read of the emptied non-blocking pipe raises instead of returning nothing."""
    read, write = os.pipe2(os.O_NONBLOCK)
    os.write(write, bytes(8192))
    _drain(read)
    with pytest.raises(BlockingIOError):
        os.read(read, 1)
    os.close(read)
    os.close(write)
