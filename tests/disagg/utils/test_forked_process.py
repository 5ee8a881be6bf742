"""A forked child used as a `Popen` (X5f): a real fork server preloading a light test module
(`fork_child.py`: one command on stdin) and its children, grandchildren included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.errors import DisaggError
from disagg.utils import forked_process
from disagg.utils.forked_process import ForkServer, adopt, inherited_server
from disagg.utils.fork_wire import send_record
from tests.process_stat import parent_of

CHILD = "tests.disagg.utils.fork_child"
ROOT = Path(__file__).resolve().parents[3]
ENV = dict(os.environ, PYTHONPATH=str(ROOT))  # `tests` importable in the server


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    server = ForkServer.launch((CHILD,), ENV)
    yield server
    server.close()



def test_a_child_is_the_servers_and_its_exit_code_comes_back(forks: ForkServer) -> None:
    process = forks.start(CHILD)
    assert parent_of(process.pid) == forks.pid
    assert process.poll() is None and process.stdin is not None
    process.stdin.write("exit 3\n")
    process.stdin.close()
    assert process.wait(timeout=30) == 3 == process.returncode


def test_a_child_asks_its_server_for_a_child_of_its_own(forks: ForkServer) -> None:
    """The grandchild's exit goes to the child that asked for it, through its own
    connection (what a TP node does for its ranks)."""
    process = forks.start(CHILD)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("nest\n")
    process.stdin.flush()
    word, _, code = process.stdout.readline().split()
    assert (word, code) == ("grandchild", "7")
    process.stdin.close()
    assert process.wait(timeout=30) == 0


def test_bytes_in_and_output_shared(forks: ForkServer) -> None:
    """As a TP rank is started: stdin in bytes, stdout and stderr fds of the asker's."""
    read, write = os.pipe()
    process = forks.start(CHILD, text=False, output=(write, write))
    os.close(write)
    assert process.stdout is None and process.stdin is not None
    process.stdin.write(b"nest\n")
    process.stdin.close()
    assert process.wait(timeout=30) == 0
    with os.fdopen(read) as shared:
        assert shared.read().split()[::2] == ["grandchild", "7"]


def test_a_killed_child_reports_minus_its_signal(forks: ForkServer) -> None:
    process = forks.start(CHILD)
    process.kill()
    assert process.wait(timeout=10) == -signal.SIGKILL
    process.kill()  # ended: nothing is sent to a pid that may be another's by now


def test_a_wait_that_runs_out_raises_as_popens_does(forks: ForkServer) -> None:
    process = forks.start(CHILD)
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.kill()
    process.wait(timeout=10)


def test_a_module_not_preloaded_is_named(forks: ForkServer) -> None:
    with pytest.raises(DisaggError, match="started no disagg.node.serve"):
        forks.start("disagg.node.serve")


def test_closing_the_server_ends_its_children() -> None:
    """They get SIGTERM when it dies, and count as ended by it once they are gone."""
    server = ForkServer.launch((CHILD,), ENV)
    process = server.start(CHILD)
    server.close()
    assert not server.alive
    assert process.wait(timeout=10) == -signal.SIGTERM


def test_a_server_that_cannot_start_is_named() -> None:
    with pytest.raises(DisaggError, match="fork server did not start"):
        ForkServer.launch((CHILD,), dict(ENV, PYTHONHOME="/nonexistent"))


def test_a_server_with_much_to_say_is_drained_into_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """Its stderr is read from the start: 256 KiB written at import does not stall it."""
    server = ForkServer.launch(("tests.disagg.utils.loud_import",), ENV, start_timeout_s=60)
    server.close()
    assert any(record.getMessage().startswith("fork server: xxx") for record in caplog.records)


def test_a_process_started_otherwise_has_no_inherited_server() -> None:
    assert inherited_server() is None


def test_an_adopted_connection_is_greeted_then_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a forked child holds before its `main()`: a connection the server greets first."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    monkeypatch.setattr(forked_process, "_adopted", None)
    monkeypatch.setattr(forked_process, "_inherited", None)
    send_record(ours, {"ready": 1, "modules": [CHILD]})
    adopt(theirs)
    server = inherited_server()
    assert server is not None and server.modules == (CHILD,) and server.pid == 1
    assert inherited_server() is server  # one connection, greeted once
    ours.close()
    deadline = time.monotonic() + 5
    while server.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inherited_server() is None  # gone with its server
    server.close()
