"""The client of a node fork server (X5f): `ForkServer` starts the server and asks it for
nodes; each node is a `ForkedProcess`, which a `LocalCluster` and its supervisor use as they
would a `subprocess.Popen` (`NodeProcess`: the part of it they use).

A forked node is the server's child, not this process's, so its exit status comes from the
server (an "exited" record, read by one thread per server) instead of `waitpid`. Signals go
straight to its pid. The server runs with the environment its nodes get (they inherit it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Protocol

from disagg.errors import DisaggError
from disagg.node.fork_wire import recv_record, send_record

SERVER_START_S = 120.0  # the imports take seconds; a loaded host can take many times that
GONE_POLL_S = 0.1


class NodeProcess(Protocol):
    """What a cluster needs of a node's process: `subprocess.Popen[str]` or `ForkedProcess`."""

    pid: int
    stdin: IO[str] | None
    stdout: IO[str] | None
    stderr: IO[str] | None

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
    """A node forked by the server, used like a `Popen` in text mode."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], stderr: IO[str],
                 exit_: _Exit) -> None:
        self.pid = pid
        self.args = ["fork_server", str(pid)]
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr
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
    """One fork server process, started with `env` (the nodes' environment), serving
    `start()` until `close()`."""

    def __init__(self, env: dict[str, str], start_timeout_s: float = SERVER_START_S) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._process = subprocess.Popen(
            [sys.executable, "-m", "disagg.node.fork_server", str(theirs.fileno())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True, env=env)
        theirs.close()
        self._exits: dict[int, _Exit] = {}
        self._lock = threading.Lock()  # the exits table, and one start in flight at a time
        self._started: list[dict] = []
        self._replied = threading.Condition(self._lock)
        ours.settimeout(start_timeout_s)
        try:
            record, _ = recv_record(ours)
        except (TimeoutError, OSError):
            record = None
        if record is None or "ready" not in record:
            self._process.kill()
            _, err = self._process.communicate()
            ours.close()
            raise DisaggError("the node fork server did not start: "
                              + " | ".join((err or "no output").strip().splitlines()[-5:]))
        ours.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="fork-server-reader",
                                        daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The server process's pid."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the server still runs (one that died starts nothing again)."""
        return self._process.poll() is None

    def start(self) -> ForkedProcess:
        """A new node process running `serve.main()`; its stdio are pipes here."""
        ends = [os.pipe() for _ in range(3)]  # (read, write) for stdin, stdout, stderr
        theirs = [ends[0][0], ends[1][1], ends[2][1]]
        try:
            with self._lock:
                send_record(self._sock, {"start": "node"}, theirs)
                while not self._started:
                    if not self._reader.is_alive():
                        raise DisaggError("the node fork server is gone")
                    self._replied.wait(timeout=1.0)
                reply = self._started.pop(0)
                if "started" not in reply:
                    raise DisaggError(f"the node fork server could not start a node: "
                                      f"{reply.get('failed')}")
                pid = reply["started"]
                exit_ = self._exits.setdefault(pid, _Exit())
        except BaseException:
            for read, write in ends:
                os.close(read)
                os.close(write)
            raise
        for fd in theirs:
            os.close(fd)
        return ForkedProcess(pid, open(ends[0][1], "w", encoding="utf-8"),
                             open(ends[1][0], encoding="utf-8"),
                             open(ends[2][0], encoding="utf-8", errors="backslashreplace"),
                             exit_)

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
                    self._started.append(record)
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
        """End the server (any node still running gets SIGTERM from its death)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stderr is not None:
            self._process.stderr.close()
