"""Argument checks of a write submission, shared by every engine that offers the API (S5, S4c).

`TransferEngine` and the in-process `testing.loopback.LoopbackEngine` both call these, so a
caller sees the same exception, with the same text, whichever engine it was handed: a test
double that validated differently would let messenger bugs pass its unit tests. The bounds
checks themselves are `memory.check_range` / `memory.check_pages`; a paged write's own checks
run when its `transport.PagedWrite` is made. Striping a paged write over domains is here too
because the receiver's count does not depend on it but `stats()` does, and so is the choice of
local domains a caller may pin a write to (S6a: rank i's pages through rank i's domain).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_core.imm_counter import MAX_IMM
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor, check_range


def as_indices(pages: Any, what: str) -> np.ndarray:
    """A flat, C-contiguous int64 copy-or-view of page ids (the C data path reads int64)."""
    indices = np.ascontiguousarray(np.asarray(pages).reshape(-1), dtype=np.int64)
    if indices.size == 0:
        raise ValueError(f"{what}: no pages")
    return indices


def as_imms(imms: Any, num_pages: int) -> np.ndarray:
    """Per-page immediate values as the C data path reads them: a flat uint32 array, one per
    page, each in 0..MAX_IMM (checked before the cast, which would wrap)."""
    values = np.asarray(imms).reshape(-1)
    if values.size != num_pages:
        raise ValueError(f"imms has {values.size} values for {num_pages} pages")
    if values.dtype.kind not in "iu":
        raise TypeError(f"imms must be integers, got {values.dtype}")
    if values.size and (int(values.min()) < 0 or int(values.max()) > MAX_IMM):
        raise ValueError(f"imms must fit in 32 bits, got {int(values.min())}.."
                         f"{int(values.max())}")
    return np.ascontiguousarray(values, dtype=np.uint32)


def check_target(provider: str, dst_mr: MemoryRegionDescriptor, imm_data: int | None) -> None:
    """The destination must be on our provider and writable; an imm must fit in 32 bits."""
    if dst_mr.provider != provider:
        raise ValueError(
            f"region {dst_mr.name!r} is on provider {dst_mr.provider!r}, "
            f"this engine uses {provider!r}"
        )
    if not dst_mr.writable:
        raise ValueError(f"region {dst_mr.name!r} is read-only at its owner")
    if imm_data is not None and not 0 <= imm_data <= MAX_IMM:
        raise ValueError(f"imm_data must fit in 32 bits, got {imm_data}")


def check_single(
    src_mr: MemoryRegion, offset: int, length: int, dst_mr: MemoryRegionDescriptor, dst_offset: int
) -> None:
    """One contiguous write of `length` bytes must fit both regions."""
    if length <= 0:
        raise ValueError(f"write length must be > 0, got {length}")
    check_range(src_mr.name, src_mr.length, offset, length)
    check_range(dst_mr.name, dst_mr.length, dst_offset, length)


def check_num_domains(num_domains: int) -> int:
    """How many domains an engine opens: at least one."""
    if num_domains < 1:
        raise ValueError(f"num_domains must be >= 1, got {num_domains}")
    return num_domains


def check_domain(domain: int, num_domains: int) -> int:
    """A local domain index a caller asked for: an int in [0, num_domains)."""
    if isinstance(domain, bool) or not isinstance(domain, int | np.integer):
        raise ValueError(f"domain index {domain!r} is not an int (num_domains={num_domains})")
    if not 0 <= domain < num_domains:
        raise ValueError(f"domain index {domain} is out of range: num_domains={num_domains}")
    return int(domain)


def check_domains(domains: Sequence[int] | None, num_domains: int) -> tuple[int, ...]:
    """The local domains a paged write is striped over: every one for None, else the given
    indices (each once, in the given order)."""
    if domains is None:
        return tuple(range(num_domains))
    if isinstance(domains, int | np.integer):
        raise ValueError(f"domains must be a sequence of indices, got {domains!r}")
    chosen = tuple(check_domain(d, num_domains) for d in domains)
    if not chosen:
        raise ValueError("domains names no domain: pass at least one index, or None for all")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"domains {list(chosen)} names a domain twice")
    return chosen


def stripe(n: int, domains: Sequence[int]) -> list[tuple[int, int, int]]:
    """Cut n pages into contiguous ranges, one per listed domain: [(domain, lo, hi)], none
    empty.

    >>> stripe(5, (0, 1))
    [(0, 0, 2), (1, 2, 5)]
    >>> stripe(5, (1,))
    [(1, 0, 5)]
    """
    k = len(domains)
    cuts = [n * i // k for i in range(k + 1)]
    return [(d, cuts[i], cuts[i + 1]) for i, d in enumerate(domains) if cuts[i] < cuts[i + 1]]
