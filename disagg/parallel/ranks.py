"""The leader's side of its TP ranks: start them, map their KV, drive them, watch them (S3c, S5a).

`TPRanks.start` runs ranks 1..N-1 as processes (`rank_worker.py`: forked by the fork server
that forked this node when there is one, X5f, else started from scratch) while the leader
loads its own shard; `connect` then takes each rank's KV memory over a Unix socket and joins the
group. Every step the leader sends its batch's inputs down each rank's socket before running
its own forward, so all ranks enter each all-reduce in the same order; a fork's page copy goes
down the same sockets (`copy_page`). A rank that dies is reported once through `on_failure`
(the node fails: its requests go elsewhere); `stop` ends every rank and leaves no process, fd,
socket or directory behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from disagg.errors import RankError
from disagg.parallel import group
from disagg.parallel.rank_spec import RankHello, RankSpec
from disagg.parallel.shared_memory import map_region, recv_message
from disagg.parallel.step import PageCopy, Step, encode_step
from disagg.utils.forked_process import ChildProcess, inherited_server

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0
RANK_ENTRY = "disagg.parallel.rank_worker"


WORKDIR_PREFIX = "disagg-tp-"


def sweep_dead_workdirs(root: str | None = None) -> list[str]:
    """Remove the private directories (socket, rendezvous file) of leaders that are gone:
    one killed with SIGKILL cannot remove its own. The leader's pid is in the name. Only this
    user's directories of dead processes go; any other name in the shared temporary
    directory (another program's, a pid no process can have) is left alone, never raised on
    (X5)."""
    # Here, not at the top: the transfer core's package loads the fabric binding, which a
    # user of the engine alone does not pay for.
    from transfer_core.leftovers import dead_leftover

    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError as error:
        logger.warning("cannot sweep %s for dead TP leaders' directories: %s", root, error)
        return []
    removed = []
    for name in names:
        if not name.startswith(WORKDIR_PREFIX):
            continue
        pid_text = name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        path = Path(root, name)
        if not dead_leftover(path, pid_text, directory=True):
            continue
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            continue  # another leader's sweep was first
        except OSError as error:
            logger.warning("could not remove a dead TP leader's directory %s: %s", path, error)
            continue
        removed.append(name)
    return removed


def _start_rank_process() -> ChildProcess:
    """A rank's process, its stdin a pipe here (bytes), its output this process's."""
    forks = inherited_server()
    if forks is not None and RANK_ENTRY in forks.modules:
        return forks.start(RANK_ENTRY, text=False, output=(1, 2))  # as Popen's inherited
    return subprocess.Popen([sys.executable, "-m", RANK_ENTRY], stdin=subprocess.PIPE)


def _describe_exit(code: int) -> str:
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class TPRanks:
    """Ranks 1..N-1 of one node, as seen by the leader (rank 0)."""

    def __init__(self, spec: RankSpec, workdir: str, server: socket.socket,
                 processes: list[ChildProcess],
                 on_failure: Callable[[BaseException], None]) -> None:
        self.spec = spec
        self._workdir = workdir
        self._server = server
        self._processes = processes
        self._on_failure = on_failure
        self._stopping = threading.Event()
        self._joined = False
        self._failed: RankError | None = None
        self._allocations: list[object] = []  # cuMem imports, kept mapped while we run
        self.kv_buffers: list[torch.Tensor] = []  # rank r's KV at index r - 1
        self._channels: dict[int, socket.socket] = {}  # rank -> its socket (fd, then steps)
        self.pids: list[int] = [p.pid for p in processes]

    @staticmethod
    def start(spec: RankSpec, on_failure: Callable[[BaseException], None]) -> TPRanks:
        """Start ranks 1..N-1 of `spec.sharding.tp` (they load their shards meanwhile)."""
        sweep_dead_workdirs()
        workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-{spec.node_id}-")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        processes: list[ChildProcess] = []
        try:
            socket_path = os.path.join(workdir, "ranks.sock")
            server.bind(socket_path)
            server.listen(spec.sharding.tp)
            world = group.GroupSpec.for_device(os.path.join(workdir, "store"),
                                               spec.sharding.tp, spec.device)
            for rank in range(1, spec.sharding.tp):
                process = _start_rank_process()
                processes.append(process)
                assert process.stdin is not None
                process.stdin.write(pickle.dumps(replace(spec, rank=rank, group=world,
                                                         socket_path=socket_path)))
                process.stdin.flush()
            ranks = TPRanks(replace(spec, group=world, socket_path=socket_path), workdir,
                            server, processes, on_failure)
        except BaseException:
            for process in processes:
                process.kill()
                process.wait()
            server.close()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return ranks

    def connect(self, timeout_s: float = 300.0) -> None:
        """Map every rank's KV memory, then join the group (all ranks are then in)."""
        try:
            deadline = time.monotonic() + timeout_s
            hellos: dict[int, torch.Tensor] = {}
            self._server.settimeout(0.2)
            while len(hellos) < len(self._processes):
                self._check_alive("before sending its KV memory")
                if time.monotonic() > deadline:
                    raise RankError(f"{len(self._processes) - len(hellos)} TP rank(s) of "
                                    f"{self.spec.node_id} sent no KV memory in {timeout_s:.0f} s")
                try:
                    conn, _ = self._server.accept()
                except TimeoutError:
                    continue
                conn.settimeout(timeout_s)
                try:
                    rank, buffer = self._receive_kv(conn)
                except BaseException:
                    conn.close()
                    raise
                conn.settimeout(None)
                self._channels[rank] = conn  # from now on: this rank's steps
                hellos[rank] = buffer
            self.kv_buffers = [hellos[rank] for rank in range(1, self.spec.sharding.tp)]
            group.join(self.spec.group, 0)
            self._joined = True
        except BaseException:
            self.stop()
            raise
        for rank, process in enumerate(self._processes, start=1):
            threading.Thread(target=self._watch, args=(rank, process), daemon=True,
                             name=f"rank{rank}-watch").start()

    def _receive_kv(self, conn: socket.socket) -> tuple[int, torch.Tensor]:
        """A rank's one hand-over message: its hello with the fd of its KV memory."""
        header, fds = recv_message(conn)
        try:
            hello = RankHello.from_header(header)
            expected = self._processes[hello.rank - 1].pid if 0 < hello.rank < len(
                self._processes) + 1 else None
            if expected != hello.pid:
                raise RankError(f"a process claiming TP rank {hello.rank} (pid {hello.pid}) is "
                                f"not one this leader started")
            if len(fds) != 1 or hello.kind not in ("memfd", "cumem"):
                raise RankError(f"TP rank {hello.rank} sent {len(fds)} fds of kind "
                                f"{hello.kind!r} for its KV memory, not 1 memfd or cumem")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        dtype = self.spec.cache.dtype
        if hello.kind == "cumem":
            from transfer_core.cuda import cumem  # cuda-python, only on CUDA ranks

            allocation = cumem.import_allocation(fds[0], hello.nbytes, hello.pci_bus_id)
            self._allocations.append(allocation)
            return hello.rank, allocation.as_tensor(dtype, hello.shape)
        region = map_region(fds[0], hello.nbytes)
        try:
            return hello.rank, region.tensor(dtype, hello.shape)
        finally:
            region.close()  # the tensor's mapping keeps the memory; the fd is not needed

    def _check_alive(self, when: str) -> None:
        for rank, process in enumerate(self._processes, start=1):
            code = process.poll()
            if code is not None:
                raise RankError(f"TP rank {rank} of {self.spec.node_id} (pid {process.pid}) "
                                f"ended {when}: {_describe_exit(code)}")

    def _watch(self, rank: int, process: ChildProcess) -> None:
        code = process.wait()
        if self._stopping.is_set():
            return
        self._failed = RankError(f"TP rank {rank} of {self.spec.node_id} (pid {process.pid}) "
                                 f"died: {_describe_exit(code)}")
        logger.error("%s", self._failed)
        self._on_failure(self._failed)

    # -- each step ------------------------------------------------------------------------

    def broadcast_step(self, step: Step) -> None:
        """Send this step's inputs to every rank (before the leader's own forward)."""
        self._broadcast(encode_step(step), "took no step")

    def copy_page(self, src: int, dst: int) -> None:
        """Have every rank copy page `src` into `dst` in its own KV shard, after the steps
        already sent and before the next (the leader copies its own shard itself)."""
        self._broadcast(encode_step(PageCopy(src, dst)), f"copied no page {src} -> {dst}")

    def _broadcast(self, frame: bytes, failed: str) -> None:
        if self._failed is not None:
            raise self._failed
        for rank, channel in self._channels.items():
            try:
                channel.sendall(frame)
            except OSError as error:
                raise self._failed or RankError(f"TP rank {rank} of {self.spec.node_id} "
                                                f"{failed}: {error}") from error

    def stop(self) -> None:
        """Tell the ranks to stop, wait for them (kill the stuck), release everything."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        stop = encode_step(None)
        for channel in self._channels.values():
            with contextlib.suppress(OSError):  # a rank may be dying too: we end them
                channel.sendall(stop)
        for process in self._processes:
            with contextlib.suppress(OSError):
                if process.stdin is not None:
                    process.stdin.close()  # a rank still loading exits on its stdin's end
        for process in self._processes:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("TP rank (pid %d) did not stop in %.0f s: killed", process.pid,
                               STOP_TIMEOUT_S)
                process.kill()
                process.wait()
        if self._joined:
            group.leave()
        for channel in self._channels.values():
            channel.close()
        self._server.close()
        shutil.rmtree(self._workdir, ignore_errors=True)
