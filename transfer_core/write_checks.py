"""Argument checks of a write submission, shared by every engine that offers the API (S5, S4c).

`TransferEngine` and the in-process `testing.loopback.LoopbackEngine` both call these, so a
caller sees the same exception, with the same text, whichever engine it was handed: a test
double that validated differently would let messenger bugs pass its unit tests. The bounds
checks themselves are `memory.check_range` / `memory.check_pages`; striping a paged write over
domains is here too because the receiver's count does not depend on it but `stats()` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from transfer_core.imm_counter import MAX_IMM
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor, check_pages, check_range


def as_indices(pages: Any, what: str) -> np.ndarray:
    """A flat, C-contiguous int64 copy-or-view of page ids (the C data path reads int64)."""
    indices = np.ascontiguousarray(np.asarray(pages).reshape(-1), dtype=np.int64)
    if indices.size == 0:
        raise ValueError(f"{what}: no pages")
    return indices


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


def check_paged(
    length: int,
    src_mr: MemoryRegion,
    src_page_indices: Sequence[int] | np.ndarray,
    src_stride: int,
    src_offset: int,
    dst_mr: MemoryRegionDescriptor,
    dst_page_indices: Sequence[int] | np.ndarray,
    dst_stride: int,
    dst_offset: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a paged write; returns the (source, destination) page ids as int64 arrays."""
    src = as_indices(src_page_indices, "src_page_indices")
    dst = as_indices(dst_page_indices, "dst_page_indices")
    if src.size != dst.size:
        raise ValueError(f"{src.size} source pages but {dst.size} destination pages")
    if length <= 0 or src_stride <= 0 or dst_stride <= 0:
        raise ValueError(f"length and strides must be > 0: {length}, {src_stride}, {dst_stride}")
    check_pages(src_mr.name, src_mr.length, src, src_stride, src_offset, length)
    check_pages(dst_mr.name, dst_mr.length, dst, dst_stride, dst_offset, length)
    return src, dst


def stripe(n: int, num_domains: int) -> list[tuple[int, int, int]]:
    """Cut n pages into contiguous ranges, one per domain: [(domain, lo, hi)], none empty."""
    cuts = [n * d // num_domains for d in range(num_domains + 1)]
    return [(d, cuts[d], cuts[d + 1]) for d in range(num_domains) if cuts[d] < cuts[d + 1]]
