"""A request's pages taken from and given to the prefix cache (`PrefixPages`, X2a)."""

from __future__ import annotations

from disagg.engine.page_allocator import PageAllocator
from disagg.engine.prefix_cache import PrefixCache
from disagg.engine.prefix_pages import PrefixPages
from disagg.engine.request import Request

PAGE = 2


def pages_with_cache(num_pages: int = 8) -> PrefixPages:
    return PrefixPages(PageAllocator(num_pages, PrefixCache(page_size=PAGE)), PAGE)


def computed(prefix: PrefixPages, request_id: str, tokens: list[int]) -> Request:
    """A request whose prompt's KV was computed in pages of its own, then registered."""
    request = Request(request_id, tokens)
    request.page_ids = prefix.allocator.allocate(-(-len(tokens) // PAGE))
    request.num_computed_tokens = len(tokens)
    prefix.register(request)
    return request


def test_registering_names_only_the_full_pages_computed_so_far() -> None:
    prefix = pages_with_cache()
    request = Request("a", [1, 2, 3, 4, 5])
    request.page_ids = prefix.allocator.allocate(3)
    request.num_computed_tokens = 3  # page 0 full, page 1 half
    prefix.register(request)
    assert len(request.page_digests) == 1
    request.num_computed_tokens = 5
    prefix.register(request)
    assert len(request.page_digests) == 2  # the last page (token 5 alone) is not full


def test_a_new_request_takes_the_cached_pages_of_all_its_tokens_but_the_last() -> None:
    prefix = pages_with_cache()
    first = computed(prefix, "a", [1, 2, 3, 4, 5, 6])
    second = Request("b", [1, 2, 3, 4, 5, 6])
    assert prefix.take(second) == 4  # pages 0 and 1: the last token must run to be sampled
    assert second.page_ids == first.page_ids[:2]
    assert second.num_computed_tokens == second.num_cached_tokens == 4
    assert [prefix.allocator.refcount(p) for p in second.page_ids] == [2, 2]


def test_releasing_a_taken_prefix_gives_back_its_references() -> None:
    prefix = pages_with_cache()
    first = computed(prefix, "a", [1, 2, 3, 4, 5])
    second = Request("b", [1, 2, 3, 4, 9])
    prefix.take(second)
    prefix.release(second)
    assert second.page_ids == [] and second.num_computed_tokens == 0
    assert [prefix.allocator.refcount(p) for p in first.page_ids[:2]] == [1, 1]


def test_a_request_that_may_not_reuse_takes_nothing_and_is_not_counted() -> None:
    prefix = pages_with_cache()
    computed(prefix, "a", [1, 2, 3, 4, 5])
    request = Request("b", [1, 2, 3, 4, 5], reuse_prefix=False)
    assert prefix.take(request) == 0 and request.page_ids == []
    prefix.record_lookup(request)
    assert prefix.allocator.cache.queried_tokens == 0


def test_a_lookup_counts_prompt_and_hit_tokens() -> None:
    prefix = pages_with_cache()
    computed(prefix, "a", [1, 2, 3, 4, 5])
    request = Request("b", [1, 2, 3, 4, 7, 8])
    prefix.take(request)
    prefix.record_lookup(request)
    cache = prefix.allocator.cache
    assert (cache.queried_tokens, cache.hit_tokens) == (6, 4)


def test_without_a_cache_every_call_is_a_no_op() -> None:
    prefix = PrefixPages(PageAllocator(4), PAGE)
    request = Request("a", [1, 2, 3, 4, 5])
    request.page_ids = prefix.allocator.allocate(3)
    request.num_computed_tokens = 5
    prefix.register(request)
    assert request.page_digests == []
    other = Request("b", [1, 2, 3, 4, 5])
    assert prefix.take(other) == 0 and other.page_ids == []
