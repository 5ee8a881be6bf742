"""Opening a peer's connection ahead of the first real write (S5; keeps S4c's counts exact).

`tcp;ofi_rxm` (and `verbs;ofi_rxm`) connect lazily: the first write to a new peer waits for
the connection, tens of ms on loopback (`benchmarks/first_write.py` measures it). `Warmup` lets
an engine pay that at handshake instead. Every engine registers, per domain, a tiny "probe"
region that nothing ever reads, and publishes its (key, raddr) in its `EngineAddress`; warming
a peer is one zero-byte `fi_write` into it per (our domain, the peer domain it maps to). Why
this and not the alternatives:

* no FI_REMOTE_CQ_DATA, so the target's CQ gets no entry (no FI_RMA_EVENT is asked for) and
  its `ImmCounterMap` counts nothing: a decoder counting a request's immediates stays exact;
* zero bytes, so no byte of the peer's memory changes; a write into a KV region instead
  would need a page nobody uses;
* a valid key: tcp;ofi_rxm drops the connection on a write with an unknown key, even a
  zero-byte one (measured: the next write paid the connection again), so "any key" fails;
* an `fi_send` of 0 bytes would need FI_MSG receives posted at the peer, or rxm would keep
  every warm-up message on its unexpected queue for good.

Idempotent: a (domain, peer endpoint) pair that succeeded is never warmed again; concurrent
callers wait on the same attempt; a failed attempt is forgotten, so a retry posts again.
The probe's key is public (it is in the address), so anyone can write its 64 bytes or send
immediates through it: the receiver's immediates are random and bounded for that reason (S5,
`imm_counter.py`), and nothing reads the probe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from transfer_core.domain_worker import DomainWorker
from transfer_core.errors import FabricError, PeerError, TransferError, TransferTimeoutError
from transfer_core.memory import EngineAddress
from transfer_core.pyfabric import MemoryRegistration, WriteOp, lib

# Bytes of the probe region: a zero-byte write needs a valid region, not room in it.
PROBE_BYTES = 64
# How long past an op's own deadline to wait before giving up on its completion.
_SLACK_S = 5.0


class _Attempt:
    """One zero-byte write to one peer endpoint; `error` is None on success."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: TransferError | None = None

    def finish(self, error: TransferError | None) -> None:
        self.error = error
        self.done.set()


class Warmup:
    """The probe region of an engine's domains and the record of peers already warmed."""

    def __init__(self, domains: Sequence[DomainWorker]) -> None:
        self._domains = list(domains)
        self._memory = np.zeros(PROBE_BYTES, np.uint8)  # owned here: registered until close()
        ptr = self._memory.ctypes.data
        self._registrations: list[MemoryRegistration] = []
        probes = []
        try:
            for worker in self._domains:
                registration = worker.register(ptr, PROBE_BYTES, lib.FI_REMOTE_WRITE, None)
                self._registrations.append(registration)
                virt = bool(worker.info.mr_mode & lib.FI_MR_VIRT_ADDR)
                probes.append((registration.key, ptr if virt else 0))
        except BaseException:
            self.close()
            raise
        self.probes: tuple[tuple[int, int], ...] = tuple(probes)
        self._lock = threading.Lock()
        self._attempts: dict[tuple[int, bytes], _Attempt] = {}

    def connect(self, provider: str, peer_address: bytes, timeout_s: float) -> None:
        """Block until each of our domains is connected to the peer domain it writes to."""
        peer = EngineAddress.from_bytes(peer_address)
        if peer.provider != provider:
            raise ValueError(
                f"peer address is on provider {peer.provider!r}, this engine uses {provider!r}"
            )
        if not peer.probes:
            raise PeerError("peer address carries no warm-up region (an older engine?)")
        waits: list[tuple[bytes, _Attempt]] = []
        posts: list[tuple[DomainWorker, bytes, tuple[int, int], _Attempt]] = []
        with self._lock:
            for d, worker in enumerate(self._domains):
                p = d % len(peer.domains)  # the same mapping as TransferEngine._post
                key = (d, peer.domains[p])
                attempt = self._attempts.get(key)
                if attempt is None or (attempt.done.is_set() and attempt.error is not None):
                    attempt = self._attempts[key] = _Attempt()
                    posts.append((worker, peer.domains[p], peer.probes[p], attempt))
                waits.append((peer.domains[p], attempt))
        deadline_ns = time.monotonic_ns() + int(timeout_s * 1e9)
        for worker, address, probe, attempt in posts:
            self._post(worker, address, probe, deadline_ns, attempt.finish)
        end = time.monotonic() + timeout_s + _SLACK_S
        for address, attempt in waits:
            if not attempt.done.wait(max(0.0, end - time.monotonic())):
                attempt.finish(TransferTimeoutError("no completion"))
            if attempt.error is not None:
                raise _wrap(attempt.error, address)

    @staticmethod
    def _post(
        worker: DomainWorker,
        address: bytes,
        probe: tuple[int, int],
        deadline_ns: int,
        on_finish: Callable[[TransferError | None], None],
    ) -> None:
        try:
            dest = worker.peer(address)
        except FabricError as exc:  # e.g. a shm peer that is gone: fails at once
            on_finish(PeerError(f"peer unreachable: {exc}"))
            return
        key, raddr = probe
        op = WriteOp(
            dest=dest, n=1, length=0, src_addr=0, src_stride=0, desc=None, dst_addr=raddr,
            dst_stride=0, key=key, deadline_ns=deadline_ns, empty=True,
        )
        try:
            worker.submit(op, on_finish)
        except TransferError as exc:  # the domain is closing or its thread died
            on_finish(exc)

    def close(self) -> None:
        """Close the probe registrations (after the domains stopped, before they close)."""
        for registration in self._registrations:
            registration.close()
        self._registrations.clear()


def _wrap(error: TransferError, address: bytes) -> TransferError:
    """Name the peer endpoint; keep timeouts timeouts, everything else is the peer's fault."""
    text = f"warming up the connection to peer endpoint {address[:32]!r}: {error}"
    if isinstance(error, TransferTimeoutError):
        return TransferTimeoutError(text)
    return PeerError(text)
