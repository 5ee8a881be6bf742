"""The messengers' KV path against prepared writes, per write, between two processes (S5, S4c,
S3b): what `disagg bench transfer` and `benchmarks/messenger_path.py` report.

A round moves L x R x P x W writes of B bytes (`Shape`; default: SmolLM2's fp32 KV of 512
tokens, 30 x 1 x 32 x 2 of 12,288) into a spawned receiver's region; W is how many writes the
plan cuts a page into (1 with matched TP; K and V, or a segment per token and head with
mismatched TP). By each of three paths:
- `messenger`: a whole forward's stream, layers back to back, as `LayerStreamer._post_layers`
  posts it (S3b): per layer ONE `post_paged_writes` carrying all R x P x W writes as byte
  offsets (`layer_writes`), checked once at layer 0 and moved to each layer (`PagedWrite.at`,
  made before the timer as the streamer makes it before the forward), each page with its
  request's immediate (`forward_writes`; the
  outgoing records are stand-ins holding only what it reads, `imm` and `peer`); the receiver
  counts L x P x W per request, as a decoder does (S4c);
- `ungrouped`: the same writes, one `post_paged_writes` per request and page write of the
  plan (R x W per layer), as the streamer posted them before `layer_writes`/`forward_writes`;
- `prepared`: each of those writes a `prepare_write` (made before the timer), `run()` back to
  back, with the same request's immediate, so the receiver counts alike.
Timed from the first post until every request's counter fired and was acknowledged and every
sender completion is in. Paths rotate (order reversed each rep); every round is checked by a
checksum of the receiver's region and its counters. No model, no poller: kv_stream.py.
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from disagg.kv_transfer.forward_writes import PeerWrite, forward_writes
from disagg.kv_transfer.layer_writes import layer_writes
from disagg.kv_transfer.transfer_plan import PageWrite
from transfer_core.engine import TransferEngine
from transfer_core.memory import MemoryRegionDescriptor
from transfer_core.transport import PagedWrite
from transfer_core.waited import PreparedWrite

PATHS = ("messenger", "ungrouped", "prepared")
IMMS = {"messenger": 0x1000_0000, "ungrouped": 0x3000_0000, "prepared": 0x2000_0000}  # + request
ACK_IMM = 0x0ACC_0000
TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Shape:
    """One round's writes, `write_bytes` each; a page holds its `page_writes` parts (K, V).

    >>> Shape(30, 1, 32, 2, 12288).num_writes
    1920
    """

    num_layers: int = 30
    num_requests: int = 1
    num_pages: int = 32  # per request: 512 tokens at page size 16
    page_writes: int = 2
    write_bytes: int = 12288  # 16 tokens x 3 KV heads x 64 dims x 4 bytes

    @property
    def num_writes(self) -> int:
        return self.num_layers * self.num_requests * self.num_pages * self.page_writes

    @property
    def region_shape(self) -> tuple[int, int, int]:
        """``[num_layers, num_requests * num_pages, page_nbytes]``, page_nbytes: W x B."""
        return (self.num_layers, self.num_requests * self.num_pages,
                self.page_writes * self.write_bytes)


def _digest(region: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(region).data, digest_size=16).hexdigest()


def _receiver(provider: str, shape: Shape, conn: Any) -> None:
    """Spawned decoder: owns the KV region, arms one counter per request, acks each."""
    with TransferEngine(provider) as engine:
        region = np.zeros(shape.region_shape, dtype=np.uint8)
        _, desc = engine.register_memory(region, name="kv-dst")
        conn.send((desc.to_bytes(), engine.address))
        ack = MemoryRegionDescriptor.from_bytes(conn.recv())
        fired: list[int] = []
        per_request = shape.num_writes // shape.num_requests

        def reached(imm: int) -> None:  # engine thread
            fired.append(imm)
            engine.post_imm(ACK_IMM, ack)

        while (msg := conn.recv())[0] != "stop":
            if msg[0] == "arm":  # a fresh round: nothing of the last one may count
                region[:] = 0
                fired.clear()
                for imm in msg[1]:
                    engine.expect_imm_count(imm, per_request, lambda imm=imm: reached(imm))
                conn.send("armed")
            else:  # "check": what landed and what was counted
                conn.send((_digest(region), sorted(fired), engine.pending_imm_counts(),
                           engine.dropped_imms))


class _Sender:
    """The prefiller's side: its KV region, each request's pages, and both paths' rounds."""

    def __init__(self, engine: TransferEngine, shape: Shape, dst: MemoryRegionDescriptor,
                 seed: int) -> None:
        self.engine, self.shape, self.dst = engine, shape, dst
        self.prepared: list[PreparedWrite] = []
        self.errors: list[BaseException] = []
        rng = np.random.default_rng(seed)
        self.src = rng.integers(0, 256, size=shape.region_shape, dtype=np.uint8)
        self.src_mr, _ = engine.register_memory(self.src, name="kv-src", remote_write=False)
        self.ack_mr, self.ack_desc = engine.register_memory(np.zeros(8, np.uint8))
        # Each request's pages, scattered on both sides as a page allocator leaves them.
        pages = shape.num_requests * shape.num_pages
        src_ids = rng.permutation(pages).reshape(shape.num_requests, shape.num_pages)
        dst_ids = rng.permutation(pages).reshape(shape.num_requests, shape.num_pages)
        self.pages = list(zip(src_ids, dst_ids, strict=True))
        self.want = np.zeros_like(self.src)
        self.want[:, dst_ids.ravel()] = self.src[:, src_ids.ravel()]
        page_nbytes = shape.region_shape[2]
        for r, src_ids, dst_ids, offset in self._paged():
            for s, d in zip(src_ids, dst_ids, strict=True):
                self.prepared.append(engine.prepare_write(
                    self.src_mr, offset + int(s) * page_nbytes, shape.write_bytes,
                    IMMS["prepared"] + r, dst, offset + int(d) * page_nbytes))

    def _paged(self) -> Iterator[tuple[int, np.ndarray, np.ndarray, int]]:
        """(request, src page ids, dst page ids, byte offset of page 0's part) of each write of
        the plan, layer by layer, request by request, page write by page write."""
        _, pages, page_nbytes = self.shape.region_shape
        for layer in range(self.shape.num_layers):
            for r, (src_ids, dst_ids) in enumerate(self.pages):
                for w in range(self.shape.page_writes):
                    offset = layer * pages * page_nbytes + w * self.shape.write_bytes
                    yield r, src_ids, dst_ids, offset

    def _merged(self) -> PeerWrite:
        """As `_post_layers` posts them: per layer ONE write of every request's pages (all to
        one receiver, one rank pair), byte offsets with stride 1 (`layer_writes`), each page
        with its request's immediate (`forward_writes`)."""
        page_nbytes, b = self.shape.region_shape[2], self.shape.write_bytes
        plan = [PageWrite(0, w * b, 0, w * b, b) for w in range(self.shape.page_writes)]
        receiver = SimpleNamespace(peer_id="receiver")
        # One value per request for every layer (the receiver counts a request under one):
        # the streamer's last layer only swaps in other values of the same shape.
        chunks = [SimpleNamespace(outgoing=SimpleNamespace(imm=IMMS["messenger"] + r,
                                                           tail_imm=IMMS["messenger"] + r,
                                                           peer=receiver),
                                  writes=layer_writes(plan, src_ids, dst_ids, page_nbytes,
                                                      page_nbytes))
                  for r, (src_ids, dst_ids) in enumerate(self.pages)]
        (merged,) = forward_writes(chunks)
        return merged

    def round(self, path: str) -> float:
        """One timed round of `path`; the receiver was armed for it."""
        acked = threading.Event()
        self.engine.expect_imm_count(ACK_IMM, self.shape.num_requests, acked.set)
        # Planned before the clock, as the streamer plans before the forward.
        calls = self._calls(merged=path == "messenger") if path != "prepared" else []
        start = time.perf_counter()
        if path != "prepared":
            done = self._post_forward(calls)
        else:
            for write in self.prepared:
                write.run()  # returns once the write is done
            done = acked
        if not (acked.wait(TIMEOUT_S) and done.wait(TIMEOUT_S)) or self.errors:
            raise RuntimeError(f"{path} round did not finish: {self.errors}")
        return time.perf_counter() - start

    def _calls(self, merged: bool) -> list[Callable[[], PagedWrite]]:
        """Every layer's paged write, made as `_post_layers` makes it (the forward's merged
        write checked once at layer 0, then moved to each layer: `PagedWrite.at`), or one
        per request and write of the plan, made in full (as it was before)."""
        _, pages, page_nbytes = self.shape.region_shape
        nbytes = self.shape.write_bytes
        if merged:
            write = self._merged()
            zero = PagedWrite(self.src_mr, write.src_offsets, 1, 0, self.dst, write.dst_offsets,
                              1, 0, nbytes, None, imms=write.imms)
            layer_nbytes = pages * page_nbytes
            return [functools.partial(zero.at, layer * layer_nbytes, layer * layer_nbytes)
                    for layer in range(self.shape.num_layers)]
        return [functools.partial(PagedWrite, self.src_mr, src, page_nbytes, offset, self.dst,
                                  dst, page_nbytes, offset, nbytes, IMMS["ungrouped"] + r)
                for r, src, dst, offset in self._paged()]

    def _post_forward(self, calls: list[Callable[[], PagedWrite]]) -> threading.Event:
        """Post `calls` back to back; the event: all completions in."""
        lock, done = threading.Lock(), threading.Event()
        left = [len(calls)]  # one on_done each

        def on_done() -> None:  # engine thread; the streamer's write_done counts likewise
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for make in calls:
            self.engine.post_paged_writes(make(), on_done=on_done, on_error=self.errors.append)
        return done

    def close(self) -> None:
        for write in self.prepared:
            write.close()
        self.engine.unregister_memory(self.src_mr)
        self.engine.unregister_memory(self.ack_mr)


def measure(provider: str, shape: Shape, reps: int, warmup: int = 1,
            seed: int = 0) -> dict[str, Any]:
    """Every path over `warmup + reps` rotating rounds; medians of the last `reps`."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"need reps >= 1 and warmup >= 0, got {reps} and {warmup}")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(provider, shape, child), daemon=True)
    proc.start()
    child.close()  # ours only: a receiver that dies then reads as EOF, not a 60 s wait
    seconds: dict[str, list[float]] = {p: [] for p in PATHS}
    verified = True
    try:
        if not parent.poll(TIMEOUT_S):
            raise TimeoutError("receiver did not start")
        desc, address = parent.recv()
        with TransferEngine(provider) as engine:
            sender = _Sender(engine, shape, MemoryRegionDescriptor.from_bytes(desc), seed)
            try:
                parent.send(sender.ack_desc.to_bytes())
                engine.connect(address)  # the first round must not pay for the connection
                want = _digest(sender.want)
                for rep in range(warmup + reps):
                    for path in PATHS if rep % 2 == 0 else PATHS[::-1]:
                        imms = [IMMS[path] + r for r in range(shape.num_requests)]
                        parent.send(("arm", imms))
                        parent.recv()
                        elapsed = sender.round(path)
                        parent.send(("check",))
                        digest, fired, pending, dropped = parent.recv()
                        verified &= (digest == want and fired == imms and not pending
                                     and not dropped)
                        if rep >= warmup:
                            seconds[path].append(elapsed)
            finally:
                sender.close()
            provider_name = engine.provider
        parent.send(("stop",))
        proc.join(TIMEOUT_S)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    n, nbytes = shape.num_writes, shape.num_writes * shape.write_bytes
    ratios = [m / p for m, p in zip(seconds["messenger"], seconds["prepared"], strict=True)]
    gains = [u / m for u, m in zip(seconds["ungrouped"], seconds["messenger"], strict=True)]
    paths = {p: {"us_per_write": statistics.median(s) / n * 1e6,
                 "us_min": min(s) / n * 1e6, "us_max": max(s) / n * 1e6,
                 "gbps": nbytes / statistics.median(s) / 1e9} for p, s in seconds.items()}
    return {"provider": provider_name, "writes": n, "write_bytes": shape.write_bytes,
            "reps": reps, "paths": paths, "messenger_over_prepared": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "ungrouped_over_messenger": statistics.median(gains),
            "verified": bool(verified and proc.exitcode == 0)}
