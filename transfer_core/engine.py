"""`TransferEngine`: one-sided RDMA writes with immediate data between processes (S5, S4c).

The libfabric implementation of `transport.Transport`, after pplx-garden's TransferEngine:
`register_memory` returns a local `MemoryRegion` and a `MemoryRegionDescriptor` (bytes) for
peers; `post_write`, `post_paged_writes` (a `PagedWrite`) and `post_imm` take
`on_done`/`on_error`; `expect_imm_count` fires once the receiver has counted the expected
writes. Several domains (NICs) each run a `DomainWorker` progress thread. The receiver's
immediate count is the truth of placement: a sender's `on_done` only means the provider is
done with the source buffer. This file checks and dispatches; its collaborators do the work:
its domains and their progress threads (`domains.py`), its registered memory
(`registration.py`), which domain a write leaves on (`write_router.py`, S6a), the receiver's
counters (`imm_counting.py`, shared with the loopback), waited writes (`waited.py`),
`connect`'s early connection (`warmup.py`), argument checks (`write_checks.py`, shared with
the loopback) and which NIC and cores each domain gets (`placement.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transfer_core.completion import OnDone, OnError
from transfer_core.domain_worker import DomainWorker
from transfer_core.domains import Domains
from transfer_core.errors import TransferError
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.imm_counting import ImmCounting
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor, resolve_buffer
from transfer_core.memory_paths import check_memory_path
from transfer_core.owner_errors import OwnerErrors
from transfer_core.phases import PhaseLog
from transfer_core.placement import plan_domains
from transfer_core.pyfabric import AUTO_NODE, DEFAULT_PROVIDERS, Stats, find_infos
from transfer_core.registration import Registrations
from transfer_core.transport import PagedWrite
from transfer_core.waited import PreparedWrite, RepeatedWrites
from transfer_core.warmup import Warmup
from transfer_core.write_checks import check_num_domains, check_single, check_target
from transfer_core.write_router import WriteRouter


class TransferEngine(ImmCounting):
    """RMA writes with immediates over libfabric; see the module docstring.

    provider: a name, an alias ("tcp", "shm", "efa", "verbs") or a preference list; the
    first one present is used. node: local address to bind ("auto": loopback for socket
    providers, every device for NIC providers). num_domains: endpoints (NICs) with one
    progress thread each, given distinct NICs where fi_getinfo lists several. cpus: cores
    the progress threads are pinned to, one each, round robin. domain_cpus: instead, the
    cores of each domain's thread (domain_cpus[d], e.g. its NIC's NUMA node). nics: the
    libfabric domain name each domain opens on (verbs `mlx5_0`; efa `rdmap16s27`, matching
    `rdmap16s27-rdm`), None for the default pick (see `placement.py`). hmem: ask for FI_HMEM
    (CUDA memory). phases: a `PhaseLog` that records when each op and each batch of
    immediates passed each step (`transfer_core.phases`). delivery_complete: sender
    completion means "placed" (costs tcp ~40%). timeout_s: default deadline of every op.
    max_inflight: writes in flight per domain and peer endpoint (default: min(64, tx/2)); a
    domain holds 4 peers' worth (`PEER_SHARES`). memory_path: the default of
    `staging.register_kv` for tensors registered with this engine (auto, host, hmem or
    staged; see `transfer_core.staging`).
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
        phases: PhaseLog | None = None,
    ) -> None:
        num_domains = check_num_domains(num_domains)
        self.memory_path = check_memory_path(memory_path)
        self.timeout_s = timeout_s
        self.phases = phases
        self._errors = OwnerErrors()
        self._domains = Domains(self._errors.guard)
        self.imm_counters = ImmCounterMap(fire=self._domains.call, on_soon=self._domains.set_eager)
        self._repeated = RepeatedWrites()
        self._closed = False
        self._warmup: Warmup | None = None
        infos = find_infos(provider, node=node, hmem=hmem, delivery_complete=delivery_complete)
        plans = plan_domains(infos, num_domains, cpus, domain_cpus, nics)
        self._registrations = Registrations(self._domains)
        # Each domain's progress thread hands its arrivals to the counters (S4c).
        on_imms, guard = self.imm_counters.on_imms, self._errors.guard
        try:
            for d, plan in enumerate(plans):
                worker = DomainWorker(d, plan.info, on_imms, guard, plan.cpus, max_inflight,
                                      phases)
                self._domains.add(worker)
            self._warmup = Warmup(self._domains)
        except BaseException:
            self.close()
            raise
        self._router = WriteRouter(self._domains, self._errors.report)
        self._info = self._domains[0].info
        self._provider = self._info.provider  # read from C on every call otherwise
        self._address = EngineAddress(
            self.provider, tuple(w.address for w in self._domains), self._warmup.probes
        )

    # -- identity ---------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self._provider

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
        region = self._registrations.register(buf, name, remote_write)
        return region, region.descriptor

    def unregister_memory(self, region: MemoryRegion) -> None:
        """Close a region's registrations; no transfer may still use it."""
        self._registrations.remove(region)
        self._repeated.forget(region)
        region.close()

    # -- writes -----------------------------------------------------------------------------

    def post_write(
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
        d = self._router.pick(domain)
        self._router.single(
            d,
            src_mr,
            offset,
            length,
            imm_data,
            dst_mr,
            dst_offset,
            on_done,
            on_error,
            self._timeout(timeout_s),
        )

    def prepare_write(
        self,
        src_mr: MemoryRegion,
        offset: int,
        length: int,
        imm_data: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> PreparedWrite:
        """Check one write (as `post_write` would) to run it, once or again and again, with
        `PreparedWrite.run()`: the caller's thread posts it and reaps its completion itself,
        with no hand-off from a progress thread (see `waited.py`)."""
        self._check_write(src_mr, dst_mr, imm_data)
        check_single(src_mr, offset, length, dst_mr, dst_offset)
        d = self._router.pick(domain)
        return self._router.prepare(
            d, self._timeout(timeout_s), src_mr, offset, length, imm_data, dst_mr, dst_offset
        )

    def write_and_wait(
        self,
        src_mr: MemoryRegion,
        offset: int,
        length: int,
        imm_data: int | None,
        dst_mr: MemoryRegionDescriptor,
        dst_offset: int,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:
        """`prepare_write(...)` and `run()` once: returns when the write is done, raises its
        TransferError if it failed. Called again with the same arguments (the same region
        objects), it runs the prepared write of the first call (`waited.RepeatedWrites`)."""
        self._check_write(src_mr, dst_mr, imm_data)
        d = self._router.pick(domain)
        key = (id(src_mr), offset, length, imm_data, id(dst_mr), dst_offset, timeout_s, d)

        def prepare() -> PreparedWrite:
            return self.prepare_write(
                src_mr, offset, length, imm_data, dst_mr, dst_offset, timeout_s=timeout_s, domain=d
            )

        self._repeated.run(key, src_mr, dst_mr, prepare)

    def post_paged_writes(
        self,
        write: PagedWrite,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Every page of `write` (checked when it was made), each write carrying `write.imm`
        (or page i `write.imms[i]`): the receiver counts `write.num_pages` immediates. Page
        ranges are striped over `write.domains` (local indices; None: all of them); `on_done`
        fires once all pages are written, `on_error` once if any failed."""
        self._check_write(write.src_mr, write.dst_mr, write.imm)
        self._router.paged(write, on_done, on_error, self._timeout(timeout_s))

    def post_imm(
        self,
        imm_data: int,
        dst_mr: MemoryRegionDescriptor,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
        domain: int | None = None,
    ) -> None:
        """A zero-byte write that only delivers `imm_data` to the owner of `dst_mr`, posted
        on local domain `domain` (None: round robin)."""
        self._check_write(None, dst_mr, imm_data)
        if imm_data is None:
            raise ValueError("post_imm needs an imm value")
        d = self._router.pick(domain)
        self._router.single(
            d, None, 0, 0, imm_data, dst_mr, 0, on_done, on_error, self._timeout(timeout_s)
        )

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
        if self._domains.on_own_thread():
            raise RuntimeError("TransferEngine.connect() would block its own callback thread")
        assert self._warmup is not None  # set in __init__ once the domains are open
        self._warmup.connect(self.provider, peer_address, self._timeout(timeout_s))

    def abandon_peer(self, peer_address: bytes) -> None:
        """Give up on every write submitted so far to the engine at `peer_address` (its
        `address` bytes), on every domain: each fails through `on_error` with a `PeerError`
        now, not at its deadline (X4: a peer declared gone, whose writes may never complete
        -- tcp;ofi_rxm keeps answering -FI_EAGAIN to a dead peer). Writes the provider holds
        are freed only once they return (G6). Writes submitted later are posted as usual.

        Raises DescriptorError for bytes that are no engine address."""
        self._check_open()
        self._domains.abandon_peer(EngineAddress.from_bytes(peer_address))

    # -- counters (expect_imm_count and the rest: inherited from ImmCounting, S4c) ----------

    def stats(self) -> list[Stats]:
        """Per-domain counters of the C worker (writes, bytes written, EAGAIN returns,
        immediates, ...)."""
        return self._domains.stats()

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, drain_s: float = 5.0) -> None:
        """Let queued ops finish (up to `drain_s`), fail the rest through `on_error`, then
        close threads, registrations and endpoints. Idempotent."""
        if self._closed:
            return
        if self._domains.on_own_thread():
            raise RuntimeError("TransferEngine.close() called from its own callback thread")
        self._closed = True
        self._domains.stop(drain_s)
        self._repeated.forget()
        self._registrations.close()
        if self._warmup is not None:
            self._warmup.close()
        self._domains.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _timeout(self, timeout_s: float | None) -> float:
        return self.timeout_s if timeout_s is None else timeout_s

    def _check_write(
        self, src_mr: MemoryRegion | None, dst_mr: MemoryRegionDescriptor, imm_data: int | None
    ) -> None:
        self._check_open()
        if src_mr is not None:
            self._registrations.check(src_mr)
        check_target(self.provider, dst_mr, imm_data)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("engine is closed")
        self._errors.raise_first()
