"""The prefix cache's digests and lookups, and the allocator's references and eviction order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.engine.page_allocator import PageAllocator
from disagg.engine.prefix_cache import ROOT, PrefixCache, cache_salt, page_digest
from disagg.errors import OutOfPagesError


def register_prompt(cache: PrefixCache, page_ids: list[int], tokens: list[int]) -> None:
    """Register `page_ids` as the full pages of `tokens`, in order."""
    parent = ROOT
    size = cache.page_size
    for index, page_id in enumerate(page_ids):
        parent = cache.register(page_id, parent, tuple(tokens[index * size:(index + 1) * size]))


def test_a_prefix_is_found_page_by_page_up_to_the_first_difference() -> None:
    cache = PrefixCache(page_size=2)
    register_prompt(cache, [5, 6, 7], [1, 2, 3, 4, 5, 6])
    assert cache.match([1, 2, 3, 4, 5, 6, 7], max_pages=9) == [5, 6, 7]
    assert cache.match([1, 2, 3, 9, 5, 6], max_pages=9) == [5]  # page 1 differs
    assert cache.match([1, 2, 3, 4, 5, 6], max_pages=2) == [5, 6]  # the caller's cap
    assert cache.match([2, 1, 3, 4], max_pages=9) == []


def test_a_page_is_named_by_its_whole_prefix_not_only_its_tokens() -> None:
    """The same two tokens after a different first page are another page."""
    cache = PrefixCache(page_size=2)
    register_prompt(cache, [5, 6], [1, 2, 3, 4])
    assert cache.match([9, 9, 3, 4], max_pages=2) == []
    register_prompt(cache, [7, 8], [9, 9, 3, 4])
    assert cache.match([9, 9, 3, 4], max_pages=2) == [7, 8]
    assert cache.match([1, 2, 3, 4], max_pages=2) == [5, 6]


def test_a_stored_page_whose_tokens_differ_is_not_a_hit() -> None:
    """Were two prefixes ever to share a digest, the token comparison still refuses the page."""
    cache = PrefixCache(page_size=2)
    register_prompt(cache, [5], [1, 2])
    digest = page_digest(cache.salt, ROOT, (3, 4))
    cache._by_digest[digest] = 5  # a forged collision: (3, 4) maps onto the page of (1, 2)
    assert cache.match([3, 4], max_pages=1) == []


def test_the_salt_separates_models_and_layouts() -> None:
    salts = {cache_salt(m, layout, 16, "float32") for m in ("a", "b") for layout in ("NHD", "HND")}
    assert len(salts) == 4
    nhd, hnd = (PrefixCache(2, cache_salt("a", layout, 2, "float32")) for layout in ("NHD", "HND"))
    assert nhd.register(0, ROOT, (1, 2)) != hnd.register(0, ROOT, (1, 2))


def test_a_prefix_computed_twice_keeps_the_first_page() -> None:
    """Two requests computed the same page at once: the second page stays unregistered."""
    cache = PrefixCache(page_size=2)
    first = cache.register(3, ROOT, (1, 2))
    assert cache.register(4, ROOT, (1, 2)) == first
    assert cache.holds(3) and not cache.holds(4)
    assert cache.match([1, 2, 0], max_pages=1) == [3]


def test_shared_pages_are_counted_and_parked_when_the_last_holder_frees() -> None:
    cache = PrefixCache(page_size=2)
    allocator = PageAllocator(4, cache)
    pages = allocator.allocate(2)
    register_prompt(cache, pages, [1, 2, 3, 4])
    allocator.share(pages)  # a second request hits both
    assert [allocator.refcount(p) for p in pages] == [2, 2]
    allocator.free(pages)
    assert allocator.num_used == 2 and cache.num_evictable == 0
    allocator.free(pages)
    assert allocator.num_used == 0 and cache.num_evictable == 2
    assert allocator.num_free == 4  # two empty, two cached but reclaimable
    allocator.share(cache.match([1, 2, 3, 4, 5], max_pages=2))  # a later hit takes them back
    assert cache.num_evictable == 0 and allocator.num_free == 2
    allocator.check_invariants()


def test_allocate_evicts_least_recently_used_and_deepest_pages_first() -> None:
    """Empty pages go first; then the LRU cached page; a request's last page before its first."""
    cache = PrefixCache(page_size=1)
    allocator = PageAllocator(5, cache)
    older = allocator.allocate(2)
    register_prompt(cache, older, [1, 2])
    newer = allocator.allocate(2)
    register_prompt(cache, newer, [3, 4])
    allocator.free(older)
    allocator.free(newer)
    assert allocator.allocate(1) == [4]  # the one empty page
    assert allocator.allocate(1) == [older[1]]  # the oldest request's deeper page
    assert cache.match([1, 2], max_pages=2) == [older[0]]
    assert allocator.allocate(2) == [older[0], newer[1]]
    assert cache.match([3, 4], max_pages=2) == [newer[0]]
    assert cache.evictions == 3
    allocator.check_invariants()


def test_held_and_pinned_pages_are_never_evicted() -> None:
    cache = PrefixCache(page_size=1)
    allocator = PageAllocator(3, cache)
    held = allocator.allocate(2)
    register_prompt(cache, held, [1, 2])
    pinned = allocator.allocate(1, pinned=True)
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    assert cache.match([1, 2], max_pages=2) == held
    with pytest.raises(ValueError, match="pinned"):
        allocator.free(pinned)
    allocator.check_invariants()


def test_sharing_a_page_that_is_neither_held_nor_cached_is_refused() -> None:
    allocator = PageAllocator(2, PrefixCache(page_size=1))
    with pytest.raises(ValueError, match="neither held nor cached"):
        allocator.share([1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "hit"]),
                          st.lists(st.integers(0, 3), min_size=1, max_size=6)), max_size=40))
def test_the_books_balance_under_any_sequence(ops: list[tuple[str, list[int]]]) -> None:
    """Random allocations, frees and hits of short prompts over a tiny cache: every page is
    empty, held or parked, and a hit's pages always hold the tokens asked for."""
    cache = PrefixCache(page_size=1)
    allocator = PageAllocator(6, cache)
    holders: list[tuple[list[int], list[int]]] = []  # (pages, tokens)
    for op, tokens in ops:
        if op == "free" and holders:
            allocator.free(holders.pop(0)[0])
        elif op == "hit":
            pages = cache.match(tokens, max_pages=len(tokens))
            allocator.share(pages)
            for index, page in enumerate(pages):
                assert cache._pages[page].token_ids == (tokens[index],)
            holders.append((pages, tokens))
        elif op == "alloc" and allocator.can_allocate(len(tokens)):
            pages = allocator.allocate(len(tokens))
            register_prompt(cache, pages, tokens)
            holders.append((pages, tokens))
        allocator.check_invariants()
    for pages, _ in holders:
        allocator.free(pages)
    allocator.check_invariants(expect_all_free=True)
