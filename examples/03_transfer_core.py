"""Step 3: the transfer core: two processes, paged RDMA writes with immediate data (S5, S4c).

A receiver process registers 16 page slots and arms a counter: "call me when 5 writes
carrying immediate 42 have landed". The sender (this process) registers 5 pages and writes them
into scattered slots of the receiver with ONE `post_paged_writes` call, over libfabric's
`tcp` provider on loopback. No message says "done": the receiver learns it from the count.
Then it does it again with immediate 43, now that the connection exists.
Pairs with docs/tutorials/03-transfer-core.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from transfer_core.engine import TransferEngine
from transfer_core.memory import MemoryRegionDescriptor
from transfer_core.transport import PagedWrite

PAGE = 4096  # bytes per page
NUM_SLOTS = 16  # pages the receiver has room for
IMMS = (42, 43)  # one immediate value per round (per request, in the real system)
DST_SLOTS = [11, 2, 7, 14, 5]  # where the sender's pages 0..4 go


def receiver() -> None:
    """The child process: a region, a counter armed before any write, then a look at memory."""
    with TransferEngine("tcp") as engine:
        region = np.zeros((NUM_SLOTS, PAGE), dtype=np.uint8)
        _, descriptor = engine.register_memory(region, name="kv")
        arrived = {imm: threading.Event() for imm in IMMS}
        for imm in IMMS:  # armed before any write lands (early arrivals would count too)
            engine.expect_imm_count(imm, len(DST_SLOTS), arrived[imm].set)
        print(descriptor.to_bytes().hex(), flush=True)  # the sender needs only these bytes
        for imm in IMMS:
            if not arrived[imm].wait(timeout=30):
                raise TimeoutError(f"only {engine.imm_counted(imm)} writes with imm {imm}")
            print(f"counter for imm {imm} reached {len(DST_SLOTS)}: the pages are here")
        for slot in np.flatnonzero(region.any(axis=1)):
            whole = bool((region[slot] == region[slot, 0]).all())
            print(f"slot {slot:>2} holds page {region[slot, 0] - 1} (all {PAGE} bytes: {whole})")


def send(descriptor: MemoryRegionDescriptor) -> None:
    """Write pages 0..4 into the receiver's slots DST_SLOTS, once per immediate value."""
    with TransferEngine("tcp") as engine:
        # Page i is filled with the byte i + 1, so the receiver can tell which page it got.
        pages = np.repeat(np.arange(1, 6, dtype=np.uint8)[:, None], PAGE, axis=1)
        region, _ = engine.register_memory(pages, name="src")
        for imm in IMMS:
            done, errors = threading.Event(), []
            start = time.perf_counter()
            write = PagedWrite(
                src_mr=region, src_page_ids=np.arange(5), src_page_stride=PAGE, src_offset=0,
                dst_mr=descriptor, dst_page_ids=DST_SLOTS, dst_page_stride=PAGE, dst_offset=0,
                nbytes=PAGE, imm=imm)  # pages 0..4 to those slots, PAGE bytes each
            engine.post_paged_writes(write, on_done=done.set, on_error=errors.append)
            posted_us = (time.perf_counter() - start) * 1e6
            if not done.wait(timeout=30) or errors:
                raise RuntimeError(f"writes did not complete: {errors}")
            done_us = (time.perf_counter() - start) * 1e6
            print(f"sender: imm {imm}: 5 writes posted in one call ({posted_us:.0f} µs), "
                  f"on_done after {done_us:.0f} µs")


def main() -> None:
    root = Path(__file__).resolve().parent.parent
    # The child imports transfer_core from this checkout even without an install.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH",
                                                                                   "")]))
    child = subprocess.Popen([sys.executable, __file__, "--receiver"], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        assert child.stdout is not None
        descriptor = MemoryRegionDescriptor.from_bytes(bytes.fromhex(child.stdout.readline()))
        print(f"receiver registered {descriptor.length} bytes; its descriptor is "
              f"{len(descriptor.to_bytes())} bytes on the wire")
        send(descriptor)
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    if child.returncode != 0:
        raise RuntimeError(f"receiver exited with {child.returncode}")
    for line in out.splitlines():
        print(f"receiver: {line}")


if __name__ == "__main__":
    receiver() if sys.argv[1:] == ["--receiver"] else main()
