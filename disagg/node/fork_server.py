"""A warm interpreter that forks a local cluster's nodes instead of starting each from scratch
(X5f): `python -m disagg.node.fork_server FD` is the server, `forked_process.py` its client.

A node's process spends most of its start importing torch and the node's modules (2.6 s of
CPU here, more than building a small model). The server imports them once, then forks one
child per node it is asked for: each child takes the three pipe ends it was sent as its
stdin, stdout and stderr and runs `serve.main()` exactly as `python -m disagg.node.serve`
would. The server is started with the environment its nodes get, which they inherit. Nothing
in the server may start a thread pool, open the fabric or touch a GPU before it forks: a
child inherits memory, never threads (the one OpenBLAS worker numpy starts at import is
parked, and OpenBLAS rebuilds its pool after a fork).

The wire (`fork_wire.py`) is a SOCK_SEQPACKET socket, one JSON record per message, pipe ends
beside a request:
  server -> client  {"ready": PID}                   imports done, requests taken
  client -> server  {"start": "node"} + 3 fds        start a node
  server -> client  {"started": PID} | {"failed": why}
  server -> client  {"exited": PID, "code": CODE}    reaped; CODE as Popen's returncode
The server serves its client until that socket closes, then exits; its children get SIGTERM
then (the parent-death signal), so a cluster whose owner died does not serve on unowned.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

from disagg.node.fork_wire import recv_record, send_record

NODE_ENTRY = "disagg.node.serve"  # its main() is what a child runs
PREFORK_MODULES = (NODE_ENTRY,)  # and everything they import: the node's code
_PR_SET_PDEATHSIG = 1


def serve(sock: socket.socket) -> None:
    """Import the node's modules, then start a child per request until the client closes."""
    for name in PREFORK_MODULES:
        __import__(name)
    wake_read, wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears it
    # Ctrl-C reaches the whole process group: the nodes stop on it, and this server when its
    # client, which owns their shutdown, closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send_record(sock, {"ready": os.getpid()})
    while True:
        readable, _, _ = select.select([sock, wake_read], [], [])
        if wake_read in readable:
            while os.read(wake_read, 4096) == 4096:
                pass
            _report_exits(sock)
        if sock in readable:
            record, fds = recv_record(sock, max_fds=3)
            if record is None:
                return
            _start_child(sock, record, fds, (wake_read, wake_write))


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        send_record(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _start_child(sock: socket.socket, record: dict[str, Any], fds: list[int],
                 wake: tuple[int, int]) -> None:
    if len(fds) != 3 or record.get("start") != "node":
        for fd in fds:
            os.close(fd)
        send_record(sock, {"failed": f"not a node's start with 3 fds: {record} ({len(fds)})"})
        return
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError as error:
        for fd in fds:
            os.close(fd)
        send_record(sock, {"failed": f"fork: {error}"})
        return
    if pid == 0:
        _run_child(sock, wake, fds, parent)  # never returns
    for fd in fds:
        os.close(fd)
    send_record(sock, {"started": pid})


def _run_child(sock: socket.socket, wake: tuple[int, int], fds: list[int], parent: int) -> None:
    """Become the node: the server's socket and signals put back, the sent pipes as stdio,
    then `serve.main()`; exits with its code, never returns."""
    code = 1
    try:
        sock.close()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in wake:
            os.close(fd)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the server died before the line above took effect
            os._exit(1)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = _text_out(1)
        sys.stderr = _text_out(2, errors="backslashreplace")
        entry = importlib.import_module(NODE_ENTRY)  # imported already, before the fork
        sys.argv = [entry.__file__]
        entry.main()  # a clean end exits inside, without the interpreter's teardown
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's last word, as an uncaught error's
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _text_out(fd: int, errors: str = "strict") -> io.TextIOWrapper:
    """A text stream on `fd` that writes through at once, as PYTHONUNBUFFERED's does."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                            errors=errors, line_buffering=True, write_through=True)


def main() -> None:
    """`python -m disagg.node.fork_server FD`: FD is this end of the client's socket."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client is gone: so is the reason to serve
    os._exit(0)  # skips torch's teardown, as a node's clean exit does


if __name__ == "__main__":
    main()
