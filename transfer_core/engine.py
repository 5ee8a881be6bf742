"""`TransferEngine`: one-sided RDMA writes with immediate data between processes (S5, S4c).

The Python surface follows pplx-garden's TransferEngine: `register_memory` returns a local
`MemoryRegion` and a `MemoryRegionDescriptor` (bytes) for peers; `submit_write`,
`submit_paged_writes` and `submit_imm` take `on_done`/`on_error`; `expect_imm_count` fires
once the receiver has counted the expected writes. Several domains (NICs) each run a
`DomainWorker` progress thread; a paged write is cut into contiguous page ranges, one per
domain, or per domain of those the caller names (S6a: rank i's pages through rank i's NIC);
local domain d writes to the peer's domain d modulo the peer's count. The receiver's
immediate count is the truth of placement: a sender's `on_done` only means the provider is
done with the source buffer. `connect` opens a peer's connection at handshake rather than on
the first write (`warmup.py`). Argument checks are shared with the loopback test double
(`write_checks.py`); which NIC and cores each domain gets is `placement.py`.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_core.domain_worker import Completion, DomainWorker, OnDone, OnError
from transfer_core.errors import PeerError, TransferError
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor, resolve_buffer
from transfer_core.memory_paths import MEMORY_PATHS
from transfer_core.owner_errors import OwnerErrors
from transfer_core.placement import plan_domains
from transfer_core.pyfabric import AUTO_NODE, DEFAULT_PROVIDERS, Stats, find_infos
from transfer_core.registration import register_on
from transfer_core.waited import PreparedWrite, RepeatedWrites, prepared_write
from transfer_core.warmup import Warmup
from transfer_core.write_checks import (  # noqa: F401  (MAX_IMM: re-exported, callers import it)
    MAX_IMM,
    check_domain,
    check_domains,
    check_paged,
    check_single,
    check_target,
    stripe,
)


class TransferEngine:
    """RMA writes with immediates over libfabric; see the module docstring.

    provider: a name, an alias ("tcp", "shm", "efa", "verbs") or a preference list; the
    first one present is used. node: local address to bind ("auto": loopback for socket
    providers, every device for NIC providers). num_domains: endpoints (NICs) with one
    progress thread each, given distinct NICs where fi_getinfo lists several. cpus: cores
    the progress threads are pinned to, one each, round robin. domain_cpus: instead, the
    cores of each domain's thread (domain_cpus[d], e.g. its NIC's NUMA node). nics: the
    libfabric domain name each domain opens on (verbs `mlx5_0`; efa `rdmap16s27`, matching
    `rdmap16s27-rdm`), None for the default pick (see `placement.py`). hmem: ask for FI_HMEM
    (CUDA memory). delivery_complete: sender completion means "placed" (costs tcp ~40%).
    timeout_s: default deadline of every op. max_inflight: writes in flight per domain
    (default: min(64, tx/2)). memory_path: the default of `staging.register_kv` for tensors
    registered with this engine (auto, host, hmem or staged; see `transfer_core.staging`).
    """

    def __init__(
        self,
        provider: str | Sequence[str] = DEFAULT_PROVIDERS,
        node: str | None = AUTO_NODE,
        num_domains: int = 1,
        cpus: Sequence[int] | None = None,
        *,
        hmem: bool = False,
        delivery_complete: bool = False,
        timeout_s: float = 30.0,
        max_inflight: int | None = None,
        memory_path: str = "auto",
        domain_cpus: Sequence[Sequence[int]] | None = None,
        nics: Sequence[str | None] | None = None,
    ) -> None:
        if num_domains < 1:
            raise ValueError(f"num_domains must be >= 1, got {num_domains}")
        if memory_path not in MEMORY_PATHS:
            raise ValueError(f"unknown memory_path {memory_path!r}: expected one of {MEMORY_PATHS}")
        self.memory_path = memory_path
        self.timeout_s = timeout_s
        self._errors = OwnerErrors()
        self._counters = ImmCounterMap(fire=self._fire)
        self._regions: list[MemoryRegion] = []
        self._repeated = RepeatedWrites()
        self._names = itertools.count()
        self._round_robin = itertools.count()
        self._closed = False
        self._threads: set[threading.Thread] = set()
        self._warmup: Warmup | None = None
        infos = find_infos(provider, node=node, hmem=hmem, delivery_complete=delivery_complete)
        plans = plan_domains(infos, num_domains, cpus, domain_cpus, nics)
        self._domains: list[DomainWorker] = []
        try:
            for d, plan in enumerate(plans):
                worker = DomainWorker(
                    d, plan.info, self._on_imms, self._errors.guard, plan.cpus, max_inflight
                )
                self._domains.append(worker)
            self._warmup = Warmup(self._domains)
        except BaseException:
            self.close()
            raise
        self._info = self._domains[0].info
        self._threads = {w.thread for w in self._domains}
        self._address = EngineAddress(
            self.provider, tuple(w.address for w in self._domains), self._warmup.probes
        )

    # -- identity ---------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self._domains[0].info.provider

    @property
    def num_domains(self) -> int:
        return len(self._domains)

    @property
    def supports_hmem(self) -> bool:
        """Whether CUDA memory can be registered: opened with `hmem=True` on a provider with
        FI_HMEM (a libfabric built with CUDA)."""
        return self._info.hmem

    @property
    def address(self) -> bytes:
        """This engine's endpoints, for peers (an `EngineAddress` as bytes)."""
        return self._address.to_bytes()

    # -- memory -----------------------------------------------------------------------------

    def register_memory(
        self, buffer: Any, name: str | None = None, *, remote_write: bool = True
    ) -> tuple[MemoryRegion, MemoryRegionDescriptor]:
        """Register a bytes-like object, numpy array or contiguous torch tensor with every
        domain. CUDA tensors need `hmem=True` and a provider with FI_HMEM (Debian's has none).

        `remote_write=False` registers a region that is only ever a write source (a
        prefiller's KV): no FI_REMOTE_WRITE, so a peer holding its key still cannot write it
        (tcp;ofi_rxm and shm enforce it: nothing lands, though the sender sees success; tcp
        then drops the connection), and its descriptor says read-only. Read-only buffers are
        sources anyway."""
        self._check_open()
        buf = resolve_buffer(buffer)
        if buf.cuda_device is not None and not self.supports_hmem:
            raise ValueError(
                f"provider {self.provider!r} was opened without FI_HMEM: cannot register CUDA "
                "memory (use TransferEngine(hmem=True) with a CUDA-enabled libfabric)"
            )
        name = name or f"mr{next(self._names)}"
        region = register_on(self._domains, self.provider, buf, name, remote_write)
        self._regions.append(region)
        return region, region.descriptor

    def unregister_memory(self, region: MemoryRegion) -> None:
        """Close a region's registrations; no transfer may still use it."""
        self._regions.remove(region)
        self._repeated.forget(region)
        region.close()

    # -- writes -----------------------------------------------------------------------------

    def submit_write(
        self,
        src_mr: MemoryRegion,
        offset: int,
        length: int,
        imm_data: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:
        """One contiguous write of `length` bytes, optionally carrying `imm_data`, posted on
        local domain `domain` (None: round robin)."""
        self._check_write(src_mr, dst_mr, imm_data)
        check_single(src_mr, offset, length, dst_mr, dst_offset)
        d = self._pick(domain)
        done = Completion(1, on_done, on_error, self._errors.report)
        self._post(
            d, done, timeout_s, src_mr, dst_mr, 1, length, offset, 0, dst_offset, 0, imm_data
        )

    def prepare_write(
        self, src_mr: MemoryRegion, offset: int, length: int, imm_data: int | None,
        dst_mr: MemoryRegionDescriptor, dst_offset: int, *, timeout_s: float | None = None,
        domain: int | None = None,
    ) -> PreparedWrite:  # fmt: skip
        """Check one write (as `submit_write` would) to run it, once or again and again, with
        `PreparedWrite.run()`: the caller's thread posts it and reaps its completion itself,
        with no hand-off from a progress thread (see `waited.py`)."""
        self._check_write(src_mr, dst_mr, imm_data)
        check_single(src_mr, offset, length, dst_mr, dst_offset)
        worker = self._domains[self._pick(domain)]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        make_op = functools.partial(
            worker.write_op, dst_mr, timeout, src_mr, 1, length, offset, 0, dst_offset, 0, imm_data
        )
        peer = dst_mr.domains[worker.index % len(dst_mr.domains)][0]
        return prepared_write(worker, make_op, peer, timeout)

    def write_and_wait(
        self, *args: Any, timeout_s: float | None = None, domain: int | None = None
    ) -> None:
        """`prepare_write(*args, ...)` and `run()` once: returns when the write is done, raises
        its TransferError if it failed. Called again with the same arguments (the same region
        objects), it runs the prepared write of the first call (`waited.RepeatedWrites`)."""
        src_mr, offset, length, imm_data, dst_mr, dst_offset = args
        self._check_write(src_mr, dst_mr, imm_data)
        d = self._pick(domain)
        key = (id(src_mr), offset, length, imm_data, id(dst_mr), dst_offset, timeout_s, d)
        prepare = lambda: self.prepare_write(*args, timeout_s=timeout_s, domain=d)  # noqa: E731
        self._repeated.run(key, src_mr, dst_mr, prepare)

    def submit_paged_writes(
        self,
        length: int,
        src_mr: MemoryRegion,
        src_page_indices: Sequence[int] | np.ndarray,
        src_stride: int,
        src_offset: int,
        dst_mr: MemoryRegionDescriptor,
        dst_page_indices: Sequence[int] | np.ndarray,
        dst_stride: int,
        dst_offset: int,
        imm_data: int | None,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
        domains: Sequence[int] | None = None,
    ) -> None:
        """Page i goes from `src_offset + src_page_indices[i] * src_stride` to
        `dst_offset + dst_page_indices[i] * dst_stride`, `length` bytes each, every write
        carrying `imm_data`: the receiver counts len(pages) immediates. Page ranges are
        striped over `domains` (local indices; None: all of them); `on_done` fires once all
        pages are written."""
        self._check_write(src_mr, dst_mr, imm_data)
        src, dst = check_paged(
            length, src_mr, src_page_indices, src_stride, src_offset,
            dst_mr, dst_page_indices, dst_stride, dst_offset,
        )  # fmt: skip
        parts = stripe(src.size, check_domains(domains, len(self._domains)))
        done = Completion(len(parts), on_done, on_error, self._errors.report)
        for d, lo, hi in parts:
            self._post(
                d, done, timeout_s, src_mr, dst_mr, hi - lo, length, src_offset, src_stride,
                dst_offset, dst_stride, imm_data, src[lo:hi], dst[lo:hi],
            )  # fmt: skip

    def submit_imm(
        self, imm_data: int, dst_mr: MemoryRegionDescriptor, on_done: OnDone | None = None,
        on_error: OnError | None = None, *, timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:  # fmt: skip
        """A zero-byte write that only delivers `imm_data` to the owner of `dst_mr`, posted
        on local domain `domain` (None: round robin)."""
        self._check_write(None, dst_mr, imm_data)
        if imm_data is None:
            raise ValueError("submit_imm needs an imm value")
        d = self._pick(domain)
        done = Completion(1, on_done, on_error, self._errors.report)
        self._post(d, done, timeout_s, None, dst_mr, 1, 0, 0, 0, 0, 0, imm_data)

    def connect(self, peer_address: bytes, *, timeout_s: float | None = None) -> None:
        """Open the connection to the engine at `peer_address` (its `address` bytes) now, so
        that the first real write does not pay for it (tens of ms on tcp;ofi_rxm, about 1 ms
        on shm: benchmarks/first_write.py). Blocks until every domain of ours is connected to
        the peer domain it writes to. The peer counts nothing and no byte of its memory
        changes (see `warmup.py`). Idempotent per peer: once warmed, a peer is not warmed
        again; should its connection drop later, the next write reconnects as it always did.

        Raises DescriptorError for bytes that are no engine address, ValueError for a peer on
        another provider, PeerError if the peer cannot be reached and TransferTimeoutError
        after `timeout_s` (default: the engine's)."""
        self._check_open()
        if threading.current_thread() in self._threads:
            raise RuntimeError("TransferEngine.connect() would block its own callback thread")
        assert self._warmup is not None  # set in __init__ once the domains are open
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self._warmup.connect(self.provider, peer_address, timeout)

    # -- immediate counters -----------------------------------------------------------------

    def expect_imm_count(self, imm: int, count: int, on_reached: OnDone) -> tuple[int, int] | None:
        """Call `on_reached` (on an engine thread) once `count` writes carrying `imm` have
        landed here, counting those that landed before this call; then forget `imm`."""
        self._check_open()
        return self._counters.expect(imm, count, on_reached)

    def remove_imm_count(self, imm: int) -> tuple[int, int] | None:
        """Drop the counter of `imm` (e.g. a cancelled request): (counted, expected) or None."""
        return self._counters.remove(imm)

    def pending_imm_counts(self) -> dict[int, tuple[int, int]]:
        """Armed counters not yet fired: imm -> (counted, expected). Empty when idle."""
        return self._counters.pending()

    def imm_counted(self, imm: int) -> int:
        """Arrivals of `imm` counted here and not yet consumed by a fired expectation."""
        return self._counters.counted(imm)

    @property
    def dropped_imms(self) -> int:
        """Arrivals of values nobody expected, thrown away: past `imm_counter`'s bound on such
        values or kept past its time (a flood, or late writes of a forgotten request)."""
        return self._counters.dropped

    def stats(self) -> list[Stats]:
        """Per-domain counters of the C worker (writes, bytes written, EAGAIN returns,
        immediates, ...)."""
        return [w.stats() for w in self._domains]

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, drain_s: float = 5.0) -> None:
        """Let queued ops finish (up to `drain_s`), fail the rest through `on_error`, then
        close threads, registrations and endpoints. Idempotent."""
        if self._closed:
            return
        if threading.current_thread() in self._threads:
            raise RuntimeError("TransferEngine.close() called from its own callback thread")
        self._closed = True
        for worker in self._domains:
            worker.stop(drain_s)
        self._repeated.forget()
        for region in self._regions:
            region.close()
        self._regions.clear()
        if self._warmup is not None:
            self._warmup.close()
        for worker in self._domains:
            worker.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _post(
        self, d: int, done: Completion, timeout_s: float | None, src_mr: MemoryRegion | None,
        dst_mr: MemoryRegionDescriptor, n: int, length: int, src_offset: int, src_stride: int,
        dst_offset: int, dst_stride: int, imm: int | None,
        src_idx: np.ndarray | None = None, dst_idx: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Queue n writes on domain d (`DomainWorker.write_op` says to which peer domain)."""
        worker = self._domains[d]
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            op = worker.write_op(
                dst_mr, timeout, src_mr, n, length, src_offset, src_stride, dst_offset,
                dst_stride, imm, src_idx, dst_idx,
            )  # fmt: skip
        except PeerError as exc:  # an unreachable peer is reported like a failed write
            error = exc
            worker.call_soon(lambda: done.part_finished(error))
            return
        worker.submit(op, done.part_finished)

    def _pick(self, domain: int | None) -> int:
        if domain is None:
            return next(self._round_robin) % len(self._domains)
        return check_domain(domain, len(self._domains))

    def _check_write(
        self, src_mr: MemoryRegion | None, dst_mr: MemoryRegionDescriptor, imm_data: int | None
    ) -> None:
        self._check_open()
        if src_mr is not None and src_mr not in self._regions:
            raise ValueError(f"region {src_mr.name!r} is not registered with this engine")
        check_target(self.provider, dst_mr, imm_data)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
        self._errors.raise_first()

    def _on_imms(self, imms: list[tuple[int, int]]) -> None:
        for imm, count in imms:
            self._counters.on_imm(imm, count)

    def _fire(self, callback: OnDone) -> None:
        if threading.current_thread() in self._threads:
            self._errors.guard(callback)
        else:
            self._domains[0].call_soon(callback)
