"""A request's pages taken from and given to the prefix cache (X2a, X2b).

The scheduler admits a request by first handing it the cached pages of its longest cached
prefix, and registers each full page once its KV is computed; a decoder's messenger does the
same for a request whose prompt arrives by RDMA (X2b), before it asks the prefiller for the
rest. Both go through this one object, so the accounting of shared pages and of the cache's
hit rate has a single owner. Without a cache, `take` gives nothing and `register` and
`record_lookup` do nothing.
"""

from __future__ import annotations

from disagg.engine.page_allocator import PageAllocator
from disagg.engine.prefix_cache import ROOT
from disagg.engine.request import Request


class PrefixPages:
    """Moves full pages between requests and the allocator's prefix cache."""

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size

    def take(self, request: Request) -> int:
        """Give a request that holds no pages the cached pages of its longest cached prefix,
        all its tokens but the last at most; returns the tokens they hold."""
        cache = self.allocator.cache
        if cache is None or not request.reuse_prefix or request.page_ids:
            return 0
        pages = cache.match(request.all_token_ids, (request.num_tokens - 1) // self.page_size)
        self.allocator.share(pages)
        request.page_ids = pages
        request.page_digests = [cache.digest_of(page) for page in pages]
        request.num_computed_tokens = request.num_cached_tokens = len(pages) * self.page_size
        return request.num_cached_tokens

    def release(self, request: Request) -> None:
        """Undo `take` for a request that could not start after all."""
        self.allocator.free(request.page_ids)
        request.page_ids, request.page_digests = [], []
        request.num_computed_tokens = request.num_cached_tokens = 0

    def record_lookup(self, request: Request) -> None:
        """Count an admitted request's prompt and hit tokens (the cache's hit rate)."""
        if self.allocator.cache is not None and request.reuse_prefix:
            self.allocator.cache.record_lookup(request.num_prompt_tokens,
                                               request.num_cached_tokens)

    def register(self, request: Request) -> None:
        """Register the request's full pages whose KV is now computed and final."""
        cache = self.allocator.cache
        size = self.page_size
        full = min(request.num_computed_tokens, request.num_tokens) // size
        if cache is None or full <= len(request.page_digests):
            return
        tokens = request.all_token_ids
        for index in range(len(request.page_digests), full):
            parent = request.page_digests[-1] if request.page_digests else ROOT
            request.page_digests.append(cache.register(
                request.page_ids[index], parent, tuple(tokens[index * size:(index + 1) * size])))
