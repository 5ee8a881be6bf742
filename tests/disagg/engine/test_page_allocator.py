"""The page allocator: all-or-nothing allocation, pinning, and loud failures on misuse."""

from __future__ import annotations

import pytest

from disagg.engine.page_allocator import PageAllocator
from disagg.errors import OutOfPagesError


@pytest.fixture
def allocator() -> PageAllocator:
    return PageAllocator(8)


def test_allocate_and_free_balance(allocator: PageAllocator) -> None:
    """Pages come back to the free list and the books balance."""
    pages = allocator.allocate(5)
    assert len(set(pages)) == 5
    assert allocator.num_free == 3
    allocator.free(pages)
    allocator.check_invariants(expect_all_free=True)


def test_out_of_pages_takes_nothing(allocator: PageAllocator) -> None:
    """A request for more pages than are free fails and leaves the free list as it was."""
    allocator.allocate(6)
    with pytest.raises(OutOfPagesError, match="asked for 3 pages, 2 free"):
        allocator.allocate(3)
    assert allocator.num_free == 2
    allocator.check_invariants()


def test_double_free_raises(allocator: PageAllocator) -> None:
    """Freeing a page twice is a bug, reported with the page id."""
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(ValueError, match=f"page {pages[0]} is not allocated"):
        allocator.free(pages[:1])
    allocator.check_invariants(expect_all_free=True)


def test_pinned_pages_cannot_be_freed_until_unpinned(allocator: PageAllocator) -> None:
    """A pinned page may still receive a write: freeing it must wait for unpin."""
    pages = allocator.allocate(3, pinned=True)
    with pytest.raises(ValueError, match="is pinned"):
        allocator.free(pages)
    assert allocator.num_free == 5  # nothing was freed by the failed call
    allocator.unpin(pages)
    allocator.free(pages)
    allocator.check_invariants(expect_all_free=True)


def test_invariant_check_catches_a_leak(allocator: PageAllocator) -> None:
    """check_invariants fails when pages are still allocated at the end of a scenario."""
    allocator.allocate(1)
    with pytest.raises(AssertionError, match="still allocated"):
        allocator.check_invariants(expect_all_free=True)
