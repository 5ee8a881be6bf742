"""Two processes move a NumPy array's pages: paged RMA writes, an immediate counter (S5, S4c).

The transfer core on its own: this file imports `transfer_core`, numpy and the standard
library, nothing of disagg, so it runs after `pip install ./transfer_core`. A `spawn`ed
receiver registers an array of page slots, arms `expect_imm_count(IMM, NUM_PAGES, ...)` and
sends its descriptor bytes back over a pipe; this process (the sender) writes scattered pages
of its own array into scattered slots with ONE `post_paged_writes` call, every write carrying
IMM. No "done" message: the receiver knows the pages are there when its counter fires, then
checks every byte. `--provider shm` runs the same over shared memory instead of tcp.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from transfer_core import MemoryRegionDescriptor, PagedWrite, TransferEngine

PAGE = 4096  # bytes per page
NUM_SLOTS = 64  # pages the receiver has room for
IMM = 7  # the immediate every write carries (one per request, in a KV cache)
SRC_PAGES = [9, 2, 30, 17, 4, 25, 11, 0]  # the sender's pages that move ...
DST_SLOTS = [40, 3, 58, 21, 12, 33, 7, 50]  # ... and where each lands
SEED = 1234


def source_pages() -> np.ndarray:
    """The sender's array, ``[32, PAGE]`` random bytes; both processes derive it from SEED."""
    return np.random.default_rng(SEED).integers(0, 256, (32, PAGE), dtype=np.uint8)


def receiver(provider: str, conn: Connection) -> None:
    """The child: register the slots, arm the counter, wait for it, verify every byte."""
    with TransferEngine(provider) as engine:
        # Register the page slots; peers need only the descriptor's bytes.
        slots = np.zeros((NUM_SLOTS, PAGE), dtype=np.uint8)
        _, descriptor = engine.register_memory(slots, name="slots")
        # Arm the counter before any write can land (early arrivals would count too).
        reached = threading.Event()
        engine.expect_imm_count(IMM, len(DST_SLOTS), reached.set)
        conn.send(descriptor.to_bytes())
        if not reached.wait(timeout=30):
            raise TimeoutError(f"only {engine.imm_counted(IMM)} of {len(DST_SLOTS)} writes "
                               f"carrying imm {IMM} arrived")
        # The counter fired: every page is in place. Check each one, and the untouched slots.
        expected = np.zeros_like(slots)
        expected[DST_SLOTS] = source_pages()[SRC_PAGES]
        wrong = [int(s) for s in np.flatnonzero((slots != expected).any(axis=1))]
        conn.send((len(DST_SLOTS), wrong))
        if wrong:
            raise AssertionError(f"slots {wrong} do not hold what the sender wrote")


def send(provider: str, descriptor: MemoryRegionDescriptor) -> float:
    """Write SRC_PAGES into the receiver's DST_SLOTS; returns the ms until `on_done`."""
    with TransferEngine(provider) as engine:
        pages = source_pages()
        # Register the source pages read-only to peers: nobody writes into them.
        region, _ = engine.register_memory(pages, name="pages", remote_write=False)
        write = PagedWrite(
            src_mr=region, src_page_ids=SRC_PAGES, src_page_stride=PAGE, src_offset=0,
            dst_mr=descriptor, dst_page_ids=DST_SLOTS, dst_page_stride=PAGE, dst_offset=0,
            nbytes=PAGE, imm=IMM,
        )  # page SRC_PAGES[i] -> slot DST_SLOTS[i], PAGE bytes each: len(SRC_PAGES) writes
        done, errors = threading.Event(), []
        start = time.perf_counter()
        engine.post_paged_writes(write, on_done=done.set, on_error=errors.append)
        if not done.wait(timeout=30) or errors:
            raise RuntimeError(f"the writes did not complete: {errors}")
        return (time.perf_counter() - start) * 1e3


def receive(conn: Connection, proc: BaseProcess, what: str) -> Any:  # noqa: ANN401
    """The receiver's next message, or an error as soon as it died or after 60 s."""
    deadline = time.monotonic() + 60
    while not conn.poll(0.1):
        if not proc.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"no {what} from the receiver (exit code {proc.exitcode})")
    return conn.recv()


def main() -> None:
    parser = argparse.ArgumentParser(description="move pages between two processes, count them")
    parser.add_argument("--provider", default="tcp", help="libfabric provider: tcp or shm")
    provider = parser.parse_args().provider
    ctx = mp.get_context("spawn")  # a fresh interpreter: no engine thread is forked
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(provider, child))
    proc.start()
    try:
        descriptor = MemoryRegionDescriptor.from_bytes(receive(parent, proc, "descriptor"))
        elapsed_ms = send(provider, descriptor)
        landed, wrong = receive(parent, proc, "result")
    finally:
        proc.join(timeout=30)
        if proc.exitcode is None:
            proc.kill()
    if proc.exitcode != 0 or wrong:
        raise SystemExit(f"receiver failed (exit code {proc.exitcode}, wrong slots {wrong})")
    print(f"{provider}: {landed} pages of {PAGE} bytes written in one paged write "
          f"(on_done after {elapsed_ms:.1f} ms); the receiver's counter for imm {IMM} fired "
          f"and every byte matched")


if __name__ == "__main__":
    main()
