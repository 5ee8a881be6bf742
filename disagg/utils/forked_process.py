"""The client of a fork server (X5f): `ForkServer` starts the server (`launch`) or speaks to
the one that forked this process (`inherited_server`), and asks it for children; each child
is a `ForkedProcess`, used as a `subprocess.Popen` would be (`ChildProcess`: the part of it
that a local cluster, its supervisor and a TP leader use).

A forked child is the server's, not this process's, so its exit status comes from the server
(an "exited" record, read by one thread per connection) instead of `waitpid`. Signals go
straight to its pid. The server runs with the environment its children get (they inherit it).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from disagg.errors import DisaggError
from disagg.utils.fork_wire import recv_record, send_record

logger = logging.getLogger(__name__)
SERVER_START_S = 120.0  # the imports take seconds; a loaded host can take many times that
GONE_POLL_S = 0.1
_adopted: socket.socket | None = None  # a forked child's own connection to its server
_inherited: ForkServer | None = None


class ChildProcess(Protocol):
    """What a cluster or a TP leader needs of a child: a `Popen` or a `ForkedProcess`."""

    pid: int
    stdin: IO[Any] | None
    stdout: IO[Any] | None
    stderr: IO[Any] | None

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


@dataclass
class _Exit:
    """Where a forked child's exit status lands once the server has reaped it."""

    done: threading.Event = field(default_factory=threading.Event)
    code: int | None = None

    def set(self, code: int) -> None:
        self.code = code
        self.done.set()


class ForkedProcess:
    """A child forked by the server, used like a `Popen`."""

    def __init__(self, pid: int, stdin: IO[Any], stdout: IO[Any] | None,
                 stderr: IO[Any] | None, exit_: _Exit) -> None:
        self.pid = pid
        self.args = ["fork_server", str(pid)]
        self.stdin: IO[Any] | None = stdin
        self.stdout: IO[Any] | None = stdout
        self.stderr: IO[Any] | None = stderr
        self._exit = exit_

    @property
    def returncode(self) -> int | None:
        """Popen's convention: the exit code, or minus the signal that ended it."""
        return self._exit.code

    def poll(self) -> int | None:
        return self._exit.code

    def wait(self, timeout: float | None = None) -> int:
        if not self._exit.done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self._exit.code is not None
        return self._exit.code

    def send_signal(self, signum: int) -> None:
        # As Popen: nothing once it is known to have ended (its pid may be another's by then).
        if self._exit.code is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One connection to a fork server: `start()` children until `close()`."""

    def __init__(self, sock: socket.socket, greeting: dict[str, Any],
                 process: subprocess.Popen[str] | None = None) -> None:
        self._sock = sock
        self.pid: int = greeting["ready"]  # the server's
        self.modules: tuple[str, ...] = tuple(greeting["modules"])  # what it may start
        self._process = process  # the server itself, when this connection started it
        self._exits: dict[int, _Exit] = {}
        self._lock = threading.Lock()  # the exits table, and one start in flight at a time
        self._replies: list[dict[str, Any]] = []
        self._replied = threading.Condition(self._lock)
        self._reader = threading.Thread(target=self._read, name="fork-server-reader",
                                        daemon=True)
        self._reader.start()

    @classmethod
    def launch(cls, modules: tuple[str, ...], env: dict[str, str],
               start_timeout_s: float = SERVER_START_S) -> ForkServer:
        """Start a server that preloads `modules`, with `env` (its children's environment);
        it lives until this connection closes."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        process = subprocess.Popen(
            [sys.executable, "-m", "disagg.utils.fork_server", str(theirs.fileno()), *modules],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=env)
        theirs.close()
        # Drained from the start, or a server with much to say (at import, or a child's error
        # before it took its own stderr) would block on a full pipe; its lines go to the log.
        last_lines: deque[str] = deque(maxlen=5)
        drain = threading.Thread(target=_log_lines, args=(process.stderr, last_lines),
                                 name="fork-server-stderr", daemon=True)
        drain.start()
        ours.settimeout(start_timeout_s)
        try:
            greeting, _ = recv_record(ours)
        except OSError:
            greeting = None
        if greeting is None or "ready" not in greeting:
            process.kill()
            process.wait()
            drain.join(timeout=5)
            ours.close()
            raise DisaggError("the fork server did not start: "
                              + (" | ".join(last_lines) or "no output"))
        ours.settimeout(None)
        return cls(ours, greeting, process)

    @property
    def alive(self) -> bool:
        """Whether the server still serves this connection (a dead one starts nothing)."""
        if self._process is not None:
            return self._process.poll() is None
        return self._reader.is_alive()

    def start(self, module: str, *, text: bool = True,
              output: tuple[int, int] | None = None) -> ForkedProcess:
        """A new child running `module.main()`, its stdin a pipe here; its stdout and stderr
        pipes here too, or `output`'s two fds (shared with this process, as `Popen`'s
        inheriting them). `text`: the pipes as text (UTF-8) or bytes."""
        pipes = [os.pipe() for _ in range(1 if output else 3)]  # (read, write) each
        theirs = [pipes[0][0], *(output or (pipes[1][1], pipes[2][1]))]
        try:
            with self._lock:
                send_record(self._sock, {"start": module}, theirs)
                while not self._replies:
                    if not self._reader.is_alive():
                        raise DisaggError("the fork server is gone")
                    self._replied.wait(timeout=1.0)
                reply = self._replies.pop(0)
                if "started" not in reply:
                    raise DisaggError(f"the fork server started no {module}: "
                                      f"{reply.get('failed')}")
                pid = reply["started"]
                exit_ = self._exits.setdefault(pid, _Exit())
        except BaseException:
            for read, write in pipes:
                os.close(read)
                os.close(write)
            raise
        os.close(pipes[0][0])
        for _, write in pipes[1:]:
            os.close(write)
        stdin = _wrap(pipes[0][1], "w", text)
        if output is not None:
            return ForkedProcess(pid, stdin, None, None, exit_)
        return ForkedProcess(pid, stdin, _wrap(pipes[1][0], "r", text),
                             _wrap(pipes[2][0], "r", text), exit_)

    def _read(self) -> None:
        """Hand each reply to its waiter; once the server is gone, wait out its children."""
        while True:
            try:
                record, _ = recv_record(self._sock)
            except OSError:
                record = None
            if record is None:
                break
            with self._lock:
                if "exited" in record:
                    self._exits.setdefault(record["exited"], _Exit()).set(record["code"])
                else:
                    self._replies.append(record)
                    self._replied.notify_all()
        with self._lock:
            self._replied.notify_all()
            orphans = {pid: box for pid, box in self._exits.items() if box.code is None}
        # Its children got SIGTERM with its death (the parent-death signal): they are no one's
        # to reap here, so they count as ended by it once their pid is gone.
        while orphans:
            for pid in [pid for pid in orphans if not os.path.exists(f"/proc/{pid}")]:
                orphans.pop(pid).set(-signal.SIGTERM)
            time.sleep(GONE_POLL_S)

    def close(self, timeout_s: float = 10.0) -> None:
        """Close this connection; if it started the server, the server ends with it (and
        any child still running gets SIGTERM from its death)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._process is None:
            return
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _log_lines(stream: IO[str], last: deque[str]) -> None:
    with stream:
        for line in stream:
            last.append(line.rstrip())
            logger.warning("fork server: %s", line.rstrip())


def _wrap(fd: int, mode: str, text: bool) -> IO[Any]:
    if text:
        return open(fd, mode, encoding="utf-8", errors="backslashreplace")
    return open(fd, mode + "b")


def adopt(connection: socket.socket) -> None:
    """In a forked child, before its `main()`: its own connection to the server."""
    global _adopted, _inherited
    _adopted, _inherited = connection, None


def inherited_server() -> ForkServer | None:
    """The fork server that forked this process, for children of its own; None in a process
    started otherwise, or once that server is gone."""
    global _inherited
    if _inherited is None and _adopted is not None:
        greeting, _ = recv_record(_adopted)
        if greeting is None:
            return None
        _inherited = ForkServer(_adopted, greeting)
    return _inherited if _inherited is not None and _inherited.alive else None
