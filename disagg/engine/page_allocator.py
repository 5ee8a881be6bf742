"""Which KV pages are free, which belong to a request, and which must not move (S2a, S4b).

A *pinned* page is non-evictable: its request waits for KV that another node is writing into it
(S2a), so the scheduler may not preempt that request and nobody may free the page until it is
unpinned. `check_invariants` is what the tests call after every scenario.
"""

from __future__ import annotations

from collections import deque

from disagg.errors import OutOfPagesError


class PageAllocator:
    """A free list of page ids `0..num_pages-1`.

    >>> allocator = PageAllocator(4)
    >>> allocator.allocate(3)
    [0, 1, 2]
    >>> allocator.num_free
    1
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._allocated: set[int] = set()
        self._pinned: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages available to `allocate`."""
        return len(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `allocate(num_pages)` would succeed."""
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int, pinned: bool = False) -> list[int]:
        """Take `num_pages` free pages (optionally pinned); all or nothing."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if not self.can_allocate(num_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, {len(self._free)} free "
                                  f"of {self.num_pages}")
        page_ids = [self._free.popleft() for _ in range(num_pages)]
        self._allocated.update(page_ids)
        if pinned:
            self._pinned.update(page_ids)
        return page_ids

    def free(self, page_ids: list[int]) -> None:
        """Return pages to the free list. Freeing a free or pinned page is a bug and raises."""
        for page_id in page_ids:
            if page_id not in self._allocated:
                raise ValueError(f"page {page_id} is not allocated (double free or bad id)")
            if page_id in self._pinned:
                raise ValueError(f"page {page_id} is pinned: unpin it before freeing")
        if len(set(page_ids)) != len(page_ids):
            raise ValueError(f"duplicate page ids in free({page_ids})")
        self._allocated.difference_update(page_ids)
        self._free.extend(page_ids)

    def pin(self, page_ids: list[int]) -> None:
        """Mark allocated pages non-evictable."""
        for page_id in page_ids:
            if page_id not in self._allocated:
                raise ValueError(f"cannot pin page {page_id}: it is not allocated")
        self._pinned.update(page_ids)

    def unpin(self, page_ids: list[int]) -> None:
        """Make pinned pages evictable again."""
        for page_id in page_ids:
            if page_id not in self._pinned:
                raise ValueError(f"cannot unpin page {page_id}: it is not pinned")
        self._pinned.difference_update(page_ids)

    def is_pinned(self, page_id: int) -> bool:
        """Whether `page_id` is pinned."""
        return page_id in self._pinned

    def check_invariants(self, expect_all_free: bool = False) -> None:
        """Assert the books balance: every page is free xor allocated, pinned ones allocated."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        both = free & self._allocated
        assert not both, f"pages both free and allocated: {sorted(both)}"
        assert free | self._allocated == set(range(self.num_pages)), "a page was leaked"
        assert self._pinned <= self._allocated, "a pinned page is not allocated"
        if expect_all_free:
            assert not self._allocated, f"pages still allocated: {sorted(self._allocated)}"
