"""A warm interpreter that forks processes instead of starting each from scratch (X5f):
`python -m disagg.utils.fork_server FD MODULE...` is the server, `forked_process.py` its client.

A node's process spends most of its start importing torch and the node's modules (2.6 s of
CPU here, more than building a small model), and so does each TP rank's. The server imports
the MODULEs once, then forks one child per request: the child takes the three fds sent beside
the request as its stdin, stdout and stderr and runs the requested MODULE's `main()`, as
`python -m MODULE` would. The server is started with the environment its children get, which
they inherit. Nothing in the server may start a thread pool, open the fabric or touch a GPU
before it forks: a child inherits memory, never threads (the one OpenBLAS worker numpy starts
at import is parked, and OpenBLAS rebuilds its pool after a fork).

Every child is a client too: it gets its own connection to the server (`forked_process.
inherited_server()`), so a TP node asks for its ranks where it was itself started. The wire
(`fork_wire.py`) is one JSON record per SOCK_SEQPACKET message, fds beside a request:
  server -> client  {"ready": PID, "modules": [...]}   first, on every connection
  client -> server  {"start": MODULE} + 3 fds          fork a child that runs MODULE.main()
  server -> client  {"started": PID} | {"failed": why}
  server -> client  {"exited": PID, "code": CODE}      reaped; CODE as Popen's returncode
The server exits when its first client (the one that started it) closes; every child gets
SIGTERM then (the parent-death signal), so nothing serves on after its owner died.
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

from disagg.utils import forked_process
from disagg.utils.fork_wire import recv_record, send_record

_PR_SET_PDEATHSIG = 1


class _Server:
    """The server's state: its clients and which of them asked for each living child."""

    def __init__(self, root: socket.socket, modules: tuple[str, ...]) -> None:
        self.root = root
        self.modules = modules
        self.clients: list[socket.socket] = [root]
        self.owners: dict[int, socket.socket] = {}  # child pid -> the client that asked
        self.wake_read, self.wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def serve(self) -> None:
        """Serve until the root client closes."""
        signal.set_wakeup_fd(self.wake_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd hears it
        # Ctrl-C reaches the whole process group: the children stop on it, and this server
        # when its root client, which owns their shutdown, closes.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.greet(self.root)
        while True:
            readable, _, _ = select.select([*self.clients, self.wake_read], [], [])
            if self.wake_read in readable:
                _drain(self.wake_read)
                self.report_exits()
            for client in readable:
                if client is self.wake_read:
                    continue
                try:
                    record, fds = recv_record(client, max_fds=3)
                except OSError:
                    record, fds = None, []
                if record is None:
                    if client is self.root:
                        return
                    self.drop(client)
                else:
                    self.start(client, record, fds)

    def greet(self, client: socket.socket) -> None:
        send_record(client, {"ready": os.getpid(), "modules": list(self.modules)})

    def drop(self, client: socket.socket) -> None:
        """A child's connection ended (it exited, or will): its children are nobody's now."""
        self.clients.remove(client)
        client.close()
        for pid in [pid for pid, owner in self.owners.items() if owner is client]:
            del self.owners[pid]

    def report_exits(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            owner = self.owners.pop(pid, None)
            if owner is not None:
                try:
                    send_record(owner, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                except OSError:
                    pass  # gone too: its EOF drops it

    def start(self, client: socket.socket, record: dict[str, Any], fds: list[int]) -> None:
        module = record.get("start")
        refusal = (f"{module!r} is not a module this server preloaded ({', '.join(self.modules)})"
                   if module not in self.modules else
                   None if len(fds) == 3 else f"a start needs 3 fds, got {len(fds)}")
        if refusal is not None:
            _close(fds)
            send_record(client, {"failed": refusal})
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError as error:
            _close([*fds, ours.detach(), theirs.detach()])
            send_record(client, {"failed": f"fork: {error}"})
            return
        if pid == 0:
            ours.close()
            self.run_child(theirs, fds, module)  # never returns
        _close(fds)
        theirs.close()
        self.clients.append(ours)
        self.owners[pid] = client
        self.greet(ours)
        send_record(client, {"started": pid})

    def run_child(self, connection: socket.socket, fds: list[int], module: str) -> None:
        """Become the child: the server's sockets and signals put back, the sent fds as
        stdio, then `module.main()`; exits with its code, never returns."""
        code = 1
        try:
            parent = os.getppid()
            for client in self.clients:
                client.close()
            signal.set_wakeup_fd(-1)
            os.close(self.wake_read)
            os.close(self.wake_write)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the server died before the line above took effect
                os._exit(1)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            _close([fd for fd in fds if fd > 2])
            sys.stdin = io.open(0, "r", encoding="utf-8", closefd=False)
            sys.stdout = _text_out(1)
            sys.stderr = _text_out(2, errors="backslashreplace")
            forked_process.adopt(connection)
            entry = importlib.import_module(module)  # imported already, before the fork
            sys.argv = [entry.__file__ or module]
            entry.main()
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


def _drain(fd: int) -> None:
    """Empty the non-blocking wake-up pipe (one byte per signal caught)."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _text_out(fd: int, errors: str = "strict") -> io.TextIOWrapper:
    """A text stream on `fd` that writes through at once, as PYTHONUNBUFFERED's does."""
    return io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)),
                            encoding="utf-8", errors=errors, line_buffering=True,
                            write_through=True)


def main() -> None:
    """`python -m disagg.utils.fork_server FD MODULE...`: FD is this end of the socket of
    the client that started it; each MODULE is imported now, and may be asked for."""
    root = socket.socket(fileno=int(sys.argv[1]))
    modules = tuple(sys.argv[2:])
    for name in modules:
        importlib.import_module(name)
    try:
        _Server(root, modules).serve()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the root client is gone: so is the reason to serve
    os._exit(0)  # skips torch's teardown, as a node's clean exit does


if __name__ == "__main__":
    main()
