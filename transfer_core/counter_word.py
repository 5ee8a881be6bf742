"""One int64 counter word as the poller and its writers see it (S3b, S3c): where it is
(`counter_address`: an address, a one-element int64 tensor or array, or anything with a
`host_address`, such as a CUDA graph's mapped counter), an acquire load (`load_acquire`, what
the poller's C wait does) and a release add (`bump_release`, the strict writer's side). Read
the NOTE below for why a layer's KV is readable once its counter shows it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeAlias

try:
    from transfer_core._poller import ffi, lib
except ImportError as exc:  # pragma: no cover - only without a build
    raise ImportError(
        "transfer_core._poller is not built: run `pip install -e .` or "
        "`python transfer_core/_poller_build.py` from the repository root"
    ) from exc

# NOTE (memory ordering: why the KV of layer i is readable once the counter shows i).
# CPU. The model thread appends layer i's KV (plain stores into the KV tensor), then runs
# `counter.add_(1)` on a CPU int64 tensor: an aligned 8-byte store, so the poller never sees a
# torn value. The poller reads with `__atomic_load_n(..., __ATOMIC_ACQUIRE)`: once it sees the
# new value, its later reads (and the reads of threads it hands work to through a lock or
# queue, e.g. the libfabric tcp provider copying from the KV region) cannot be satisfied from
# before that load. On x86-64 (TSO) stores become visible in program order, so the KV stores
# are visible before the counter store and acquire on the reader is all that is needed. On
# weakly ordered CPUs (aarch64) torch's plain store gives no release order; a writer there that
# needs the guarantee should bump with `bump_release(counter)` from this module.
# GPU. The counter is a word of mapped pinned host memory
# (`transfer_core.cuda.mapped_counter.MappedCounter`); a kernel captured in the CUDA graph does
# `add_(1)` on its device alias after layer i's output projection. On one stream a kernel starts
# only after the previous one has completed, so when the bump kernel runs, the kernel that appended
# layer i's KV (several kernels earlier, before attention) has finished and its writes sit in GPU
# memory (L2 is the point of coherence for device memory, and PCIe peer reads by a NIC or
# copy-engine reads go through it). The bump is a posted PCIe write into host memory; x86 DMA is
# cache coherent, so the acquire load sees it without flushes. Hence a NIC that starts reading layer
# i's KV after the host saw the count is reading a completed kernel's output. Honest limits: (1) the
# CUDA docs promise this visibility to third-party readers only after a host-side synchronisation
# (event or stream sync); the argument above relies on kernel completion in stream order, which is
# how the hardware works, not a documented contract. (2) `__threadfence_system()` orders the writes
# of the calling thread, as seen by all observers including the host and peers, before its later
# writes; it is cumulative, so a bump kernel doing `__threadfence_system()` before its store would
# make the ordering formal, but torch's `add_` does not issue it, and a fence in the KV-append
# kernel alone would not order writes of other threads. (3) Programmatic dependent launch or running
# the bump on another stream would break the argument. (4) With TP, the leader's bump follows the
# output projection's all-reduce, which cannot finish before every rank has entered it, i.e. after
# each rank's own KV append kernel has completed (S3c). Never use write-combined memory for
# counters: the CPU reads them.


class HasHostAddress(Protocol):
    """A counter living in memory the CPU can read, e.g.
    `transfer_core.cuda.mapped_counter.MappedCounter`."""

    @property
    def host_address(self) -> int: ...


if TYPE_CHECKING:
    import numpy as np
    import torch

    CounterLike: TypeAlias = int | HasHostAddress | torch.Tensor | np.ndarray


def counter_address(counter: CounterLike) -> int:
    """The host address of one int64 counter word.

    Accepts an int address, a `MappedCounter` (anything with `host_address`), or a CPU torch
    tensor / numpy array of dtype int64 with exactly one element (a one-element slice of a
    bigger tensor is fine). The word must be 8-byte aligned so loads are single-copy atomic.
    """
    if isinstance(counter, int):
        address = counter
    elif hasattr(counter, "host_address"):
        address = int(counter.host_address)
    elif hasattr(counter, "data_ptr") and hasattr(counter, "device"):  # torch.Tensor
        if counter.device.type != "cpu":
            raise ValueError(
                f"counter tensor is on {counter.device}; the CPU cannot read device memory, "
                "pass a MappedCounter (mapped pinned host memory) instead"
            )
        _check_word(str(counter.dtype), "torch.int64", counter.numel())
        address = counter.data_ptr()
    elif hasattr(counter, "__array_interface__"):  # numpy array
        _check_word(str(counter.dtype), "int64", counter.size)
        address = counter.__array_interface__["data"][0]
    else:
        raise TypeError(f"cannot watch a {type(counter).__name__}; pass a tensor, array or int")
    if address == 0 or address % 8:
        raise ValueError(f"counter address {address:#x} is null or not 8-byte aligned")
    return address


def _check_word(dtype: str, want: str, numel: int) -> None:
    if dtype != want or numel != 1:
        raise ValueError(f"a counter is one {want} element, got dtype {dtype} with {numel}")


def load_acquire(counter: CounterLike) -> int:
    """Read a counter word with an acquire load, as the poller does."""
    return int(lib.tc_load_acquire(ffi.cast("int64_t *", counter_address(counter))))


def bump_release(counter: CounterLike, delta: int = 1) -> int:
    """Add `delta` with release order (a CPU writer's strict alternative to `add_`); new value."""
    return int(lib.tc_fetch_add_release(ffi.cast("int64_t *", counter_address(counter)), delta))
