"""Where KV memory meets the fabric: registered directly, through FI_HMEM, or staged (S5, S5a).

`choose_memory_path` decides per tensor: CPU memory registers as is ("host"); CUDA memory
registers as is when the engine's provider was opened with FI_HMEM ("hmem"), else it goes
through a pinned host shadow ("staged"), which a user may also force, CPU tensors included:
that is how the staging path is tested without a GPU. `register_kv` registers accordingly and
returns a `RegisteredKV`: the sender calls `stage_out(layer, page_ids)` before posting a layer's
writes, the receiver `stage_in(page_ids)` once a request's writes have all landed; both are
no-ops unless the path is "staged". The trade-off: a full-size shadow keeps every byte offset
identical, so transfer plans and descriptors do not change at all, but it costs host memory
equal to the KV cache. The production refinement is a bounded ring of bounce slots (pages
copied into a free slot, written from there, the slot reused once the write completed); it is
named here, not built. torch (the torch extra) is imported by the calls that copy or allocate,
so the module imports without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from transfer_core.errors import BoundsError, FabricError, ProviderNotFoundError
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.memory_paths import MEMORY_PATHS, MemoryPathKind
from transfer_core.optional import require_torch
from transfer_core.transport import Transport

if TYPE_CHECKING:  # torch is the torch extra: imported where a tensor is copied
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=Transport)


@dataclass(frozen=True, slots=True)
class MemoryPath:
    """How one tensor reaches the NIC, and why that way."""

    kind: MemoryPathKind
    reason: str


def choose_memory_path(tensor: torch.Tensor, engine: Transport,
                       requested: str = "auto") -> MemoryPath:
    """The path for `tensor` on `engine`: "auto" picks, "host", "hmem" or "staged" insist.

    ============  ==============  ===================================================
    requested     CPU tensor      CUDA tensor
    ============  ==============  ===================================================
    auto          host            hmem if `engine.supports_hmem`, else staged
    host          host            ValueError (the NIC cannot read device memory as host)
    hmem          ValueError      hmem, or ValueError naming the provider
    staged        staged          staged
    ============  ==============  ===================================================
    """
    if requested not in MEMORY_PATHS:
        raise ValueError(f"unknown KV memory path {requested!r}: expected one of {MEMORY_PATHS}")
    device = tensor.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"cannot register KV memory on device {device}")
    if requested == "staged":
        return MemoryPath("staged", f"{device.type} memory, staging requested")
    if device.type == "cpu":
        if requested == "hmem":
            raise ValueError("KV memory path 'hmem' needs a CUDA tensor, the KV cache is on cpu")
        return MemoryPath("host", "host memory, registered directly")
    if requested == "host":
        raise ValueError(f"KV memory path 'host' cannot register {device} memory: "
                         "use auto, hmem or staged")
    if engine.supports_hmem:
        return MemoryPath("hmem", f"provider {engine.provider!r} has FI_HMEM: "
                                  f"{device} memory registered directly")
    why = f"provider {engine.provider!r} was opened without FI_HMEM"
    if requested == "hmem":
        raise ValueError(f"KV memory path 'hmem' is unavailable: {why} (open the engine with "
                         "hmem=True on a libfabric built with CUDA, or use staged)")
    return MemoryPath("staged", f"{why}: {device} memory staged through pinned host memory")


def open_engine(make: Callable[[bool], T], want_hmem: bool) -> T:
    """An engine for KV memory, `make(hmem)` opening it: with `want_hmem` (device KV, path auto
    or hmem) it asks for FI_HMEM first and, where no provider offers it, opens without and says
    why; then `register_kv` stages (auto) or names the provider (hmem).

    `make` is e.g. ``lambda hmem: TransferEngine("tcp", hmem=hmem)``."""
    if want_hmem:
        try:
            return make(True)
        except ProviderNotFoundError as error:
            logger.info("no provider offers FI_HMEM (%s): opening without it", error)
    return make(False)


def page_runs(page_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
    """Distinct page ids as sorted half-open runs of consecutive ids, one copy each.

    >>> page_runs([7, 3, 4, 5, 9, 8])
    [(3, 6), (7, 10)]
    """
    ids = np.unique(np.asarray(page_ids, dtype=np.int64).reshape(-1))
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [ids.size]))
    return [(int(ids[s]), int(ids[e - 1]) + 1) for s, e in zip(starts, ends, strict=True)]


@dataclass(eq=False)
class RegisteredKV:
    """A KV tensor as the fabric sees it: `region` and `descriptor` cover `shadow` when staged
    (same shape, host memory), else the tensor itself.

    `tensor` is ``[num_layers, num_pages, ...page dims]``: a layer's page is one contiguous
    block, which is what makes a run of pages one copy. `staged_bytes` counts bytes copied in
    either direction, for metrics.
    """

    tensor: torch.Tensor
    region: MemoryRegion
    descriptor: MemoryRegionDescriptor
    path: MemoryPath
    shadow: torch.Tensor | None = None
    staged_bytes: int = 0
    _stream: torch.cuda.Stream | None = field(default=None, repr=False)

    @property
    def staged(self) -> bool:
        """Whether the fabric reads and writes a host shadow rather than the tensor."""
        return self.shadow is not None

    def stage_out(self, layer: int | range, page_ids: Sequence[int] | np.ndarray, *,
                  wait_for_compute: bool = False) -> None:
        """Sender: copy pages `page_ids` of `layer` (or of a run of layers posted together)
        into the shadow and wait once for the copies.

        On CUDA they run on the copy stream and do not wait for the compute stream: the layer
        counter is the fence (the host saw layer `layer` finish, see the NOTE in `counter_word.py`).
        With no counter to vouch for the data (e.g. pages written after the forward), pass
        `wait_for_compute=True` to order the copies after the work already queued.
        """
        if self.shadow is not None:
            layers = range(layer, layer + 1) if isinstance(layer, int) else layer
            self._copy([(self.tensor[i], self.shadow[i]) for i in layers], page_ids,
                       wait_for_compute)

    def stage_in(self, page_ids: Sequence[int] | np.ndarray, layers: range | None = None
                 ) -> None:
        """Receiver: copy `layers` (None: every layer) of pages `page_ids` from the shadow
        into the tensor.

        On CUDA the copy stream first waits for the compute stream, so no kernel queued
        earlier can still read those pages while they are overwritten.
        """
        if self.shadow is not None:
            layers = range(self.tensor.shape[0]) if layers is None else layers
            self._copy([(self.shadow[i], self.tensor[i]) for i in layers], page_ids, True)

    def _copy(self, layers: list[tuple[torch.Tensor, torch.Tensor]],
              page_ids: Sequence[int] | np.ndarray, wait_for_compute: bool) -> None:
        """Copy each run of pages of each (src, dst) layer pair, then wait once."""
        runs = page_runs(page_ids)
        num_pages = self.tensor.shape[1]
        if runs and (runs[0][0] < 0 or runs[-1][1] > num_pages):
            raise BoundsError(f"KV region {self.region.name!r}: page ids {runs[0][0]}.."
                              f"{runs[-1][1] - 1} outside [0, {num_pages})")
        if self._stream is None:
            for src, dst in layers:  # [num_pages, ...page dims] each
                for start, end in runs:
                    dst[start:end].copy_(src[start:end])
        else:
            torch = require_torch("transfer_core.staging")
            if wait_for_compute:
                self._stream.wait_stream(torch.cuda.current_stream(self.tensor.device))
            with torch.cuda.stream(self._stream):
                for src, dst in layers:
                    for start, end in runs:
                        dst[start:end].copy_(src[start:end], non_blocking=True)
            self._stream.synchronize()  # one wait per call, after every copy was queued
        page_nbytes = self.tensor[0, 0].numel() * self.tensor.element_size()
        self.staged_bytes += len(layers) * sum(end - start for start, end in runs) * page_nbytes

    def close(self, engine: Transport) -> None:
        """Unregister the region (after the engine drained); the shadow goes with this object."""
        engine.unregister_memory(self.region)


def register_kv(engine: Transport, tensor: torch.Tensor, name: str,
                path: MemoryPath | str | None = None, *,
                remote_write: bool = True) -> RegisteredKV:
    """Register a KV tensor ``[num_layers, num_pages, ...]`` through its memory path.

    `path` is a `MemoryPath`, or what to ask `choose_memory_path` for (None: the engine's
    `memory_path`). Staged tensors get a zeroed shadow of the same shape and dtype in host
    memory, pinned when CUDA is present, and a dedicated copy stream on CUDA. `remote_write`
    says whether peers write this KV (a decoder's) or only read from it (a prefiller's):
    sources are registered without FI_REMOTE_WRITE (`Transport.register_memory`).
    """
    if tensor.dim() < 2:
        raise ValueError(f"a KV tensor is [num_layers, num_pages, ...], got {tuple(tensor.shape)}")
    requested = engine.memory_path if path is None else path
    if isinstance(requested, MemoryPath):
        chosen = requested
    else:
        chosen = choose_memory_path(tensor, engine, requested)
    if requested == "auto" and chosen.kind == "hmem":
        try:
            return _register(engine, tensor, name, chosen, remote_write)
        except FabricError as error:
            # FI_HMEM may cover other device kinds only (Debian's shm: system memory).
            chosen = MemoryPath("staged", f"registering {tensor.device} memory failed: {error}")
    return _register(engine, tensor, name, chosen, remote_write)


def _register(engine: Transport, tensor: torch.Tensor, name: str,
              path: MemoryPath, remote_write: bool) -> RegisteredKV:
    shadow, stream = None, None
    if path.kind == "staged":
        torch = require_torch("transfer_core.staging")
        pin = torch.cuda.is_available()
        shadow = torch.zeros(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        if tensor.device.type == "cuda":
            stream = torch.cuda.Stream(tensor.device)
    region, descriptor = engine.register_memory(tensor if shadow is None else shadow, name,
                                                remote_write=remote_write)
    logger.info("KV region %s: %s (%s)", name, path.kind, path.reason)
    return RegisteredKV(tensor, region, descriptor, path, shadow, _stream=stream)
