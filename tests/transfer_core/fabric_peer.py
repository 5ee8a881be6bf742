"""A spawned receiver process for two-process transfer tests, driven over a Pipe (S5, S4c).

The test process is the sender; `Peer` runs a `TransferEngine` in a `spawn`ed child that owns
a destination region, sets imm expectations on command, records how often each counter's
callback fired, and reports page digests. One request/response per command keeps it simple.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import threading
from typing import Any

import numpy as np

from transfer_core.memory import MemoryRegionDescriptor

NUM_PAGES = 256
PAGE = 16 * 1024


def digest(pages: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(pages).data, digest_size=16).hexdigest()


def _serve(provider: str, conn: Any) -> None:
    from transfer_core.engine import TransferEngine

    engine = TransferEngine(provider)
    region = np.zeros((NUM_PAGES, PAGE), dtype=np.uint8)
    _, desc = engine.register_memory(region, name="peer-dst")
    fired: dict[int, int] = {}
    reached: dict[int, threading.Event] = {}
    lock = threading.Lock()

    def on_reached(imm: int) -> None:
        with lock:
            fired[imm] = fired.get(imm, 0) + 1
        reached[imm].set()

    conn.send(desc.to_bytes())
    try:
        while True:
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "expect":
                imm, count = args
                reached[imm] = threading.Event()
                engine.expect_imm_count(imm, count, lambda imm=imm: on_reached(imm))
                conn.send(None)
            elif cmd == "wait":
                imm, timeout = args
                reached[imm].wait(timeout)
                with lock:
                    conn.send(fired.get(imm, 0))
            elif cmd == "counted":
                conn.send(engine.imm_counted(args[0]))
            elif cmd == "digest":
                conn.send(digest(region[np.asarray(args[0])]))
            elif cmd == "zero":
                region[:] = 0
                conn.send(None)
    finally:
        engine.close()
        conn.send("closed")


class Peer:
    """Handle of the receiver process: its region descriptor and a command channel."""

    def __init__(self, provider: str, timeout_s: float = 30.0) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._timeout = timeout_s
        self.process = ctx.Process(target=_serve, args=(provider, child), daemon=True)
        self.process.start()
        self.descriptor = MemoryRegionDescriptor.from_bytes(self._recv())

    def _recv(self) -> Any:
        if not self._conn.poll(self._timeout):
            raise TimeoutError("receiver process did not answer")
        return self._conn.recv()

    def call(self, *command: Any) -> Any:
        self._conn.send(command)
        return self._recv()

    def stop(self) -> None:
        """Close the receiver's engine cleanly and wait for the process to exit."""
        if self.process.is_alive():
            assert self.call("stop") == "closed"
            self.process.join(self._timeout)
        assert self.process.exitcode == 0
