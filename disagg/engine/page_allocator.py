"""Which KV pages are free, which requests hold them, and which must not move (S2a, S4b, X2a).

A *pinned* page is non-evictable: its request waits for KV that another node is writing into it
(S2a), so the scheduler may not preempt that request and nobody may free the page until it is
unpinned. With a `PrefixCache` a full page can be held by several requests at once (they share
a prefix), so the allocator counts references; a registered page whose last holder lets go is
parked in the cache, still holding its KV, and evicted only when `allocate` runs out of empty
pages. `check_invariants` is what the tests call after every scenario.
"""

from __future__ import annotations

from collections import deque

from disagg.engine.prefix_cache import PrefixCache
from disagg.errors import OutOfPagesError


class PageAllocator:
    """A free list of page ids `0..num_pages-1`, with reference counts.

    >>> allocator = PageAllocator(4)
    >>> allocator.allocate(3)
    [0, 1, 2]
    >>> allocator.num_free
    1
    """

    def __init__(self, num_pages: int, cache: PrefixCache | None = None) -> None:
        self.num_pages = num_pages
        self.cache = cache
        self._free: deque[int] = deque(range(num_pages))  # empty pages
        self._refs: dict[int, int] = {}  # page -> requests holding it
        self._pinned: set[int] = set()

    @property
    def num_free(self) -> int:
        """Pages available to `allocate`: empty ones and cached ones no request holds."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Pages some request holds."""
        return len(self._refs)

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `allocate(num_pages)` would succeed."""
        return num_pages <= self.num_free

    def allocate(self, num_pages: int, pinned: bool = False) -> list[int]:
        """Take `num_pages` pages (optionally pinned); all or nothing. Empty pages go first,
        then the least recently used cached ones are evicted."""
        if num_pages < 0:
            raise ValueError(f"cannot allocate {num_pages} pages")
        if not self.can_allocate(num_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, {self.num_free} free "
                                  f"of {self.num_pages}")
        page_ids = [self._free.popleft() if self._free else self.cache.evict()  # type: ignore[union-attr]
                    for _ in range(num_pages)]
        for page_id in page_ids:
            self._refs[page_id] = 1
        if pinned:
            self._pinned.update(page_ids)
        return page_ids

    def share(self, page_ids: list[int]) -> None:
        """Hold cached pages for one more request (prefix hits): held ones gain a reference,
        parked ones come out of the eviction order."""
        for page_id in page_ids:
            if page_id in self._refs:
                self._refs[page_id] += 1
            elif self.cache is not None and self.cache.is_evictable(page_id):
                self.cache.unpark(page_id)
                self._refs[page_id] = 1
            else:
                raise ValueError(f"page {page_id} is neither held nor cached: cannot share it")

    def free(self, page_ids: list[int]) -> None:
        """Let go of pages, last first. A page nobody holds any more goes back to the free
        list, or, if the prefix cache knows it, to the cache's eviction order. Freeing a page
        not held or pinned is a bug and raises, before anything changes."""
        for page_id in page_ids:
            if page_id not in self._refs:
                raise ValueError(f"page {page_id} is not allocated (double free or bad id)")
            if page_id in self._pinned:
                raise ValueError(f"page {page_id} is pinned: unpin it before freeing")
        if len(set(page_ids)) != len(page_ids):
            raise ValueError(f"duplicate page ids in free({page_ids})")
        # Last page first: a prefix's deeper pages become the older entries of the LRU, so
        # they are evicted before the pages they extend.
        for page_id in reversed(page_ids):
            self._refs[page_id] -= 1
            if self._refs[page_id]:
                continue
            del self._refs[page_id]
            if self.cache is not None and self.cache.holds(page_id):
                self.cache.park(page_id)
            else:
                self._free.append(page_id)

    def pin(self, page_ids: list[int]) -> None:
        """Mark allocated pages non-evictable."""
        for page_id in page_ids:
            if page_id not in self._refs:
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

    def refcount(self, page_id: int) -> int:
        """How many requests hold `page_id` (0 if none)."""
        return self._refs.get(page_id, 0)

    def check_invariants(self, expect_all_free: bool = False) -> None:
        """Assert the books balance: every page is empty, held or parked in the cache (exactly
        one), pinned ones are held, and with `expect_all_free` no request holds any page."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        held = set(self._refs)
        assert all(n > 0 for n in self._refs.values()), "a held page has no reference"
        parked = {p for p in range(self.num_pages) if self.cache and self.cache.is_evictable(p)}
        for name, a, b in (("free and held", free, held), ("free and cached", free, parked),
                           ("held and parked", held, parked)):
            assert not a & b, f"pages both {name}: {sorted(a & b)}"
        assert free | held | parked == set(range(self.num_pages)), "a page was leaked"
        assert self._pinned <= held, "a pinned page is not allocated"
        if self.cache is not None:
            self.cache.check_invariants()
            cached_free = [p for p in free if self.cache.holds(p)]
            assert not cached_free, f"registered pages on the free list: {cached_free}"
        if expect_all_free:
            assert not held, f"pages still allocated: {sorted(held)}"
