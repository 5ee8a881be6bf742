"""A CPU model's weights in transparent huge pages (X8f).

A decode step streams every weight once (X8a), and with 4 KiB pages that is a TLB miss every
4 KiB: about 46,000 per SmolLM2 bfloat16 step. Linux backs anonymous memory with 2 MiB pages
where asked (`madvise(MADV_HUGEPAGE)`, transparent huge pages in "madvise" or "always" mode),
but only for memory asked before its first touch, and torch's allocations are not. So
`into_huge_pages` copies the parameters into one arena asked for huge pages before anything
touches it, and points each parameter at its place there (`param.data`, as a cast does; the
decode layers' table of weight addresses is forgotten, to be rebuilt at the next decode). A
copy: the values, and every result, keep their bits. Where the kernel has no transparent huge
pages, or the platform no `madvise`, nothing moves.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch
from torch import nn

from disagg.model import layer_weights

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each parameter starts on a cache line, as the C kernels' loads prefer
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this kernel gives transparent huge pages to memory that asks for them."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def _movable(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The contiguous CPU parameters among `params` whose bytes no other parameter shares.
    Parameters that are views of one loaded buffer side by side move (each is copied out);
    two that overlap (one a view of the other, a tie) stay, so that the tie holds."""
    spans: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for p in params:
        if p.device.type == "cpu" and p.is_contiguous() and p.numel():
            base = p.untyped_storage().data_ptr()
            start = p.data_ptr() - base
            spans.setdefault(base, []).append((start, start + p.numel() * p.element_size(), p))
    movable = []
    for group in spans.values():
        group.sort(key=lambda span: span[0])
        for i, (start, end, p) in enumerate(group):
            before = i > 0 and group[i - 1][1] > start
            after = i + 1 < len(group) and group[i + 1][0] < end
            if not (before or after):
                movable.append(p)
    return movable


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of anonymous memory asked for huge pages, untouched, starting on a huge page."""
    # Private: Python's default for anonymous maps is shared memory, which takes huge pages
    # under another setting (shmem_enabled, "never" by default).
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def into_huge_pages(model: nn.Module) -> int:
    """Move `model`'s CPU parameters into huge pages (`_movable`: all but overlapping ones);
    returns the bytes moved (0 where huge pages are not available)."""
    if not huge_pages_available():
        return 0
    params = _movable(list(model.parameters()))
    if not params:
        return 0
    nbytes = [p.numel() * p.element_size() for p in params]
    arena = huge_page_buffer(sum(_aligned(n) for n in nbytes))
    offset = 0
    with torch.no_grad():
        for param, n in zip(params, nbytes, strict=True):
            place = arena[offset:offset + n].view(param.dtype).view(param.shape)
            place.copy_(param.data)
            param.data = place
            offset += _aligned(n)
    layer_weights.forget(model)  # the decode step's weight addresses moved (X8e)
    return offset
