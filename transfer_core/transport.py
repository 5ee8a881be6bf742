"""`Transport`: what a messenger uses of a transfer engine, and `PagedWrite`, its paged write
(S5, S4c).

Three classes implement the protocol: `engine.TransferEngine` (libfabric), the in-process
`testing.loopback.LoopbackEngine` (unit tests) and `faults.FaultyTransport` (a wrapper over
either that injects faults). By side:
- identity: `provider`, `num_domains`, `supports_hmem`, `memory_path`, `address`, `timeout_s`;
- memory: `register_memory`, `unregister_memory`;
- sender: `connect`, `post_write`, `post_paged_writes`, `post_imm`, `write_and_wait`,
  `abandon_peer`;
- receiver (S4c): `expect_imm_count`, `remove_imm_count`, `pending_imm_counts`,
  `imm_counted`, `dropped_imms`, `tap_imms` (one implementation: `imm_counting.py`);
- lifecycle: `stats`, `close`.
This file holds no behaviour: `tests/transfer_core/test_transport.py` checks every engine
against it, member by member.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from transfer_core.completion import OnDone, OnError
from transfer_core.imm_counter import ImmTap
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor, check_pages, pages_fit
from transfer_core.pyfabric import Stats
from transfer_core.write_checks import as_imms, as_indices

# How `staging.register_kv` places a tensor's memory: "auto" picks host, hmem or staged.

PageIds = Sequence[int] | np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class PagedWrite:
    """One paged write: page i goes from byte `src_offset + src_page_ids[i] * src_page_stride`
    of `src_mr` to byte `dst_offset + dst_page_ids[i] * dst_page_stride` of `dst_mr`, `nbytes`
    bytes each, every write carrying `imm` (None: no immediate), so the receiver counts one
    immediate per page. With `imms` instead of `imm`, page i carries `imms[i]`: one paged write
    can carry the pages of several requests to one peer, each counted under its own value.
    `domains`: the local domains the pages are striped over, in order (None: all of them; S6a
    pins rank i's pages to rank i's domains).

    Checked when made: the page ids become flat int64 arrays (the C data path reads them),
    both lists pair up one to one, and every page lies inside its region (`BoundsError`,
    naming the region). What depends on an engine (is `src_mr` registered with it, are
    `domains` its own, does `imm` fit) is checked by the engine the write is submitted to.
    """

    src_mr: MemoryRegion
    src_page_ids: PageIds
    src_page_stride: int
    src_offset: int
    dst_mr: MemoryRegionDescriptor
    dst_page_ids: PageIds
    dst_page_stride: int
    dst_offset: int
    nbytes: int
    imm: int | None
    domains: Sequence[int] | None = None
    imms: PageIds | None = None
    # The lowest and highest page id of each side, found by the checks (for `at`).
    _src_extent: tuple[int, int] = field(init=False, repr=False)
    _dst_extent: tuple[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        src = as_indices(self.src_page_ids, "src_page_ids")
        dst = as_indices(self.dst_page_ids, "dst_page_ids")
        if src.size != dst.size:
            raise ValueError(f"{src.size} source pages but {dst.size} destination pages")
        if self.imms is not None:
            if self.imm is not None:
                raise ValueError("a paged write carries imm (every page) or imms (per page)")
            object.__setattr__(self, "imms", as_imms(self.imms, src.size))
        if self.nbytes <= 0 or self.src_page_stride <= 0 or self.dst_page_stride <= 0:
            raise ValueError(
                f"nbytes and page strides must be > 0: {self.nbytes}, "
                f"{self.src_page_stride}, {self.dst_page_stride}"
            )
        src_mr, dst_mr = self.src_mr, self.dst_mr
        src_extent = check_pages(
            src_mr.name, src_mr.length, src, self.src_page_stride, self.src_offset, self.nbytes
        )
        dst_extent = check_pages(
            dst_mr.name, dst_mr.length, dst, self.dst_page_stride, self.dst_offset, self.nbytes
        )
        object.__setattr__(self, "src_page_ids", src)  # frozen: set once, here
        object.__setattr__(self, "dst_page_ids", dst)
        object.__setattr__(self, "_src_extent", src_extent)
        object.__setattr__(self, "_dst_extent", dst_extent)

    def at(self, src_offset: int, dst_offset: int, *, imms: PageIds | None = None
           ) -> PagedWrite:
        """This write from and to other base offsets (a later layer's pages, say), sharing
        its checked page ids and immediates: only the bounds are checked again, from the
        lowest and highest ids found when this write was made (`BoundsError` as when made).
        `imms`: other per-page values for a write that carries per-page values (checked as
        when made), e.g. a request's last layer, counted under a value of its own."""
        if imms is not None:
            if self.imms is None:
                raise ValueError("only a write with per-page imms can take other imms")
            imms = as_imms(imms, self.num_pages)
        src_mr, dst_mr, nbytes = self.src_mr, self.dst_mr, self.nbytes
        if not (pages_fit(src_mr.length, self._src_extent, self.src_page_stride, src_offset,
                          nbytes)
                and pages_fit(dst_mr.length, self._dst_extent, self.dst_page_stride,
                              dst_offset, nbytes)):
            check_pages(src_mr.name, src_mr.length, self.src_page_ids, self.src_page_stride,
                        src_offset, nbytes)
            check_pages(dst_mr.name, dst_mr.length, self.dst_page_ids, self.dst_page_stride,
                        dst_offset, nbytes)
        moved = object.__new__(PagedWrite)
        for name in PagedWrite.__slots__:
            object.__setattr__(moved, name, getattr(self, name))
        object.__setattr__(moved, "src_offset", src_offset)
        object.__setattr__(moved, "dst_offset", dst_offset)
        if imms is not None:
            object.__setattr__(moved, "imms", imms)
        return moved

    @property
    def num_pages(self) -> int:
        """Pages in this write: the receiver counts this many immediates (if `imm` is set)."""
        return len(self.src_page_ids)

    def src_byte_offsets(self) -> np.ndarray:
        """Where each page starts in `src_mr`: ``[num_pages]`` int64."""
        return self.src_offset + np.asarray(self.src_page_ids) * self.src_page_stride

    def dst_byte_offsets(self) -> np.ndarray:
        """Where each page lands in `dst_mr`: ``[num_pages]`` int64."""
        return self.dst_offset + np.asarray(self.dst_page_ids) * self.dst_page_stride


@runtime_checkable
class Transport(Protocol):
    """One-sided writes with immediates between engines, and the receiver's counters.

    Callbacks (`on_done`, `on_error`, `on_reached`) run on an engine thread; an exception
    they raise resurfaces on the owner's next call. A sender's `on_done` means the source
    buffer may be reused, not that the bytes were placed: the receiver's count is the truth.
    """

    timeout_s: float  # the default deadline of every operation, in seconds

    # -- identity ---------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        """The libfabric provider in use ("tcp;ofi_rxm", "shm", ...; "loopback")."""
        ...

    @property
    def num_domains(self) -> int:
        """Local domains (endpoints, NICs), each with its own progress thread."""
        ...

    @property
    def supports_hmem(self) -> bool:
        """Whether CUDA memory can be registered as is (FI_HMEM)."""
        ...

    @property
    def memory_path(self) -> str:
        """The default of `staging.register_kv` for tensors registered here (MEMORY_PATHS)."""
        ...

    @property
    def address(self) -> bytes:
        """This engine's endpoints, for peers (an `EngineAddress` as bytes)."""
        ...

    # -- memory -----------------------------------------------------------------------------

    def register_memory(
        self, buffer: Any, name: str | None = None, *, remote_write: bool = True
    ) -> tuple[MemoryRegion, MemoryRegionDescriptor]:
        """Register a buffer with every domain: the local handle and the peers' descriptor."""
        ...

    def unregister_memory(self, region: MemoryRegion) -> None:
        """Close a region's registrations; no transfer may still use it."""
        ...

    # -- sender -----------------------------------------------------------------------------

    def connect(self, peer_address: bytes, *, timeout_s: float | None = None) -> None:
        """Open the connection to the engine at `peer_address` before the first write."""
        ...

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
        """One contiguous write of `length` bytes, optionally carrying `imm_data`."""
        ...

    def post_paged_writes(
        self,
        write: PagedWrite,
        on_done: OnDone | None = None,
        on_error: OnError | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Every page of `write`; `on_done` once all are written, or `on_error` once."""
        ...

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
        """A zero-byte write that only delivers `imm_data` to the owner of `dst_mr`."""
        ...

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
        """`post_write`'s write, returning once done; raises its TransferError."""
        ...

    def abandon_peer(self, peer_address: bytes) -> None:
        """Fail every write submitted so far to the engine at `peer_address` now (X4)."""
        ...

    # -- receiver (S4c) ---------------------------------------------------------------------

    def expect_imm_count(self, imm: int, count: int, on_reached: OnDone) -> tuple[int, int] | None:
        """Call `on_reached` once `count` writes carrying `imm` have landed here."""
        ...

    def expect_soon(self, imm: int, at_once: bool = False) -> bool:
        """The writes the counter of `imm` waits for are due within milliseconds (`at_once`:
        back to back, with no pause): the engine notices arrivals sooner until it fires or is
        removed. False if none is armed."""
        ...

    def remove_imm_count(self, imm: int) -> tuple[int, int] | None:
        """Drop the counter of `imm`: (counted, expected) if one was armed, else None."""
        ...

    def pending_imm_counts(self) -> dict[int, tuple[int, int]]:
        """Armed counters not yet fired: imm -> (counted, expected)."""
        ...

    def imm_counted(self, imm: int) -> int:
        """Arrivals of `imm` counted here and not yet consumed by a fired expectation."""
        ...

    @property
    def dropped_imms(self) -> int:
        """Arrivals of values nobody expected, thrown away."""
        ...

    def tap_imms(self, tap: ImmTap) -> None:
        """Pass every batch of arriving immediates through `tap` before it is counted."""
        ...

    # -- lifecycle --------------------------------------------------------------------------

    def stats(self) -> list[Stats]:
        """Per-domain counters (writes, bytes written, immediates, ...)."""
        ...

    def close(self, drain_s: float = 5.0) -> None:
        """Let queued ops finish (up to `drain_s`), fail the rest, release everything."""
        ...
