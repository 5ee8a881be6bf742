"""Transfer benchmark: the peers' workload (`benchmarks/peers`), between two processes (S5, S4c).

A sender writes `num_pages` pages of `page_bytes` to shuffled slots of a receiver's region
with `post_paged_writes`, one immediate value per request. A rep is timed from submit until
the receiver's counter fires and its acknowledging immediate is back at the sender (the
target's count is the truth of placement). By default the reps run back to back, as the peers'
harnesses and `fi_rma_bw` run theirs: the receiver arms every rep's counter up front, and the
region, zeroed once before the first rep, is verified once after the last by a checksum of
the receiver's pages read in the shuffled order. Both sides mark what they wait for as due at
once (`expect_soon(..., at_once=True)`), so their workers poll their completion queues between
batches, as the peers' harnesses and `fi_rma_bw` poll theirs, rather than sleep on a tcp
completion fd and pay its wake-up twice a batch. With `verify_each_rep` the receiver zeroes
its region before every rep and verifies it after: each rep then meets a receiver that has
just spent ~10 ms hashing (a cold batch, as a request's first layer meets an idle decoder).
With `one_buffer` every write reads the sender's one page and lands on the receiver's one
page, as libfabric's `fi_rma_bw` does (source and target stay in cache): the provider's limit
through our engine, to set beside `fi_rma_bw`'s. Then `latency_iters` single 4 KiB writes are
timed one at a time, submit to sender completion; each carries an immediate like every KV
write does (on shm a write without one takes the sender-side copy path, whose tail depends on
the idle target's naps). Waits for an idle machine first and reports medians;
`run_transfer_benchmark` is what `benchmarks/transfer.py` and `disagg bench transfer` call.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import statistics
import threading
import time
from typing import Any

import numpy as np

from transfer_core.engine import TransferEngine
from transfer_core.memory import MemoryRegionDescriptor
from transfer_core.transport import PagedWrite

LATENCY_IMM = 0xFFFF_FFFF  # counted (and ignored) by the receiver


def cpu_busy_fraction(interval_s: float) -> float:
    """Share of non-idle CPU time over `interval_s`, from /proc/stat."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    idle0, total0 = sample()
    time.sleep(interval_s)
    idle1, total1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(threshold: float = 0.10, window_s: float = 2.0, cap_s: float = 60.0) -> float:
    """Block until the machine was < `threshold` busy for `window_s` (at most `cap_s`).
    Returns the last busy fraction seen."""
    deadline = time.monotonic() + cap_s
    busy = cpu_busy_fraction(window_s)
    while busy >= threshold and time.monotonic() < deadline:
        busy = cpu_busy_fraction(window_s)
    return busy


def memcpy_gbps(nbytes: int, reps: int = 3) -> float:
    """This machine's single-thread copy bandwidth right now (median of `reps` copies of
    `nbytes`): the yardstick that tells a slow transport from a slow or busy machine."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _digest(pages: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(pages).data, digest_size=16).hexdigest()


def _receiver_main(
    provider: str, num_pages: int, region_pages: int, page_bytes: int, conn: Any
) -> None:
    """Spawned target: owns the destination region, counts immediates, acknowledges."""
    with TransferEngine(provider) as engine:
        region = np.zeros((region_pages, page_bytes), dtype=np.uint8)
        _, desc = engine.register_memory(region, name="bench-dst")
        conn.send((desc.to_bytes(),))
        (ack_bytes,) = conn.recv()
        ack = MemoryRegionDescriptor.from_bytes(ack_bytes)
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "arm":
                _, imms = msg
                region[:] = 0
                for imm in imms:
                    engine.expect_imm_count(imm, num_pages, lambda i=imm: engine.post_imm(i, ack))
                    # The sender posts as soon as it hears "armed", batch after batch.
                    engine.expect_soon(imm, at_once=True)
                conn.send(("armed",))
            elif msg[0] == "digest":
                conn.send(("digest", _digest(region[msg[1]])))


class _Sender:
    """The sending side's engine and regions; each rep waits for the receiver's ack."""

    def __init__(
        self, provider: str, num_pages: int, page_bytes: int, seed: int, one_buffer: bool
    ) -> None:
        self.engine = TransferEngine(provider)
        rng = np.random.default_rng(seed)
        region_pages = 1 if one_buffer else num_pages
        self.src = rng.integers(0, 256, size=(region_pages, page_bytes), dtype=np.uint8)
        # source page i lands in slot perm[i]
        self.src_ids = np.arange(num_pages) % region_pages
        self.perm = self.src_ids if one_buffer else rng.permutation(num_pages)
        self.src_mr, _ = self.engine.register_memory(self.src, name="bench-src", remote_write=False)
        self.ack = np.zeros(8, dtype=np.uint8)
        _, self.ack_desc = self.engine.register_memory(self.ack, name="bench-ack")
        self.errors: list[BaseException] = []

    def paged_rep(self, dst: MemoryRegionDescriptor, imm: int,
                  timeout_s: float) -> tuple[float, float]:
        """Seconds from submit to the receiver's ack (the count of placed writes, what the
        benchmark reports), and to this side's last completion (where the peers' harnesses
        stop their clocks: the initiator's view, which on tcp says sent, not placed)."""
        acked, done = threading.Event(), threading.Event()
        completed: list[float] = []

        def on_done() -> None:
            completed.append(time.perf_counter())
            done.set()

        self.engine.expect_imm_count(imm, 1, acked.set)
        self.engine.expect_soon(imm, at_once=True)  # the ack follows the batch
        page_bytes = self.src.shape[1]
        start = time.perf_counter()
        write = PagedWrite(
            src_mr=self.src_mr,
            src_page_ids=self.src_ids,
            src_page_stride=page_bytes,
            src_offset=0,
            dst_mr=dst,
            dst_page_ids=self.perm,
            dst_page_stride=page_bytes,
            dst_offset=0,
            nbytes=page_bytes,
            imm=imm,
        )
        self.engine.post_paged_writes(write, on_done, self.errors.append)
        if not acked.wait(timeout_s):
            raise TimeoutError(f"rep imm={imm}: receiver did not acknowledge ({self.errors})")
        elapsed = time.perf_counter() - start
        if not done.wait(timeout_s):
            raise TimeoutError(f"rep imm={imm}: sender completions missing ({self.errors})")
        return elapsed, completed[0] - start

    def latencies_us(self, dst: MemoryRegionDescriptor, nbytes: int, iters: int) -> list[float]:
        out: list[float] = []
        done = threading.Event()
        finished: list[int] = []

        def on_done() -> None:
            finished.append(time.perf_counter_ns())
            done.set()

        for _ in range(iters):
            done.clear()
            start = time.perf_counter_ns()
            self.engine.post_write(
                self.src_mr, 0, nbytes, LATENCY_IMM, dst, 0, on_done, self.errors.append
            )
            if not done.wait(10.0):
                raise TimeoutError(f"latency write did not complete ({self.errors})")
            out.append((finished[-1] - start) / 1e3)
        return out


def run_transfer_benchmark(
    provider: str = "tcp",
    num_pages: int = 2048,
    page_bytes: int = 65536,
    reps: int = 5,
    warmup: int = 1,
    latency_bytes: int = 4096,
    latency_iters: int = 2000,
    wait_idle: bool = True,
    seed: int = 0,
    timeout_s: float = 120.0,
    verify_each_rep: bool = False,
    one_buffer: bool = False,
) -> dict[str, Any]:
    """Run the peer workload between this process and a spawned receiver; returns medians:
    keys provider, gbps, us_per_page, latency_us_p50, latency_us_p99, verified, and more.
    `verify_each_rep`: zero and verify the receiver's region around every rep (cold batches)
    instead of once around all of them (back to back, the peers' protocol). `one_buffer`: all
    writes from one page to one page (`fi_rma_bw`'s pattern), not distinct shuffled pages."""
    busy = wait_for_idle() if wait_idle else cpu_busy_fraction(0.2)
    copy_gbps = memcpy_gbps(num_pages * page_bytes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    region_pages = 1 if one_buffer else num_pages
    proc = ctx.Process(
        target=_receiver_main, args=(provider, num_pages, region_pages, page_bytes, child)
    )
    proc.start()
    sender = None
    try:
        if not parent.poll(timeout_s):
            raise TimeoutError("receiver did not start")
        dst = MemoryRegionDescriptor.from_bytes(parent.recv()[0])
        sender = _Sender(provider, num_pages, page_bytes, seed, one_buffer)
        parent.send((sender.ack_desc.to_bytes(),))
        want = _digest(sender.src[sender.src_ids])
        imms = list(range(1, warmup + reps + 1))
        rounds = [[imm] for imm in imms] if verify_each_rep else [imms]
        timed, verified = [], True
        for armed in rounds:
            parent.send(("arm", armed))
            parent.recv()
            timed += [sender.paged_rep(dst, imm, timeout_s) for imm in armed]
            parent.send(("digest", sender.perm))
            verified &= parent.recv()[1] == want
        seconds = [acked for acked, _ in timed[warmup:]]
        local_seconds = [local for _, local in timed[warmup:]]
        lat = sender.latencies_us(dst, latency_bytes, latency_iters)
        parent.send(("stop",))
        proc.join(timeout_s)
    finally:
        if sender is not None:
            sender.engine.close()
        if proc.is_alive():
            proc.kill()
            proc.join()
    total = num_pages * page_bytes
    gbps = [total / s / 1e9 for s in seconds]
    return {
        "provider": sender.engine.provider if sender else provider,
        "num_pages": num_pages,
        "page_bytes": page_bytes,
        "reps": reps,
        "warmup": warmup,
        "verify_each_rep": verify_each_rep,
        "one_buffer": one_buffer,
        "gbps": statistics.median(gbps),
        "gbps_min": min(gbps),
        "gbps_max": max(gbps),
        "gbps_reps": [round(g, 3) for g in gbps],
        # to the sender's own completions, as the peers' harnesses time a batch
        "gbps_initiator": statistics.median(total / s / 1e9 for s in local_seconds),
        "us_per_page": statistics.median(seconds) / num_pages * 1e6,
        "latency_bytes": latency_bytes,
        "latency_us_p50": float(np.percentile(lat, 50)),
        "latency_us_p99": float(np.percentile(lat, 99)),
        "verified": bool(verified and proc.exitcode == 0),
        "cpu_busy_before": round(busy, 3),
        "cpus": os.cpu_count(),
        "memcpy_gbps": round(copy_gbps, 2),
    }
