"""Full pages kept after their request ends, found again by what they hold (prefix caching, X2a).

A full page is named by a chained digest: SHA-256 of the salt (model, layout, page size,
dtype), the parent page's digest and the page's own token ids. So one digest names a whole
prefix, and two requests that share their first k pages of tokens find the same k digests.

NOTE on exactness. A lookup walks the chain from the first page and stops at the first miss. At
every step it also compares the stored page's token ids and parent digest with its own, so a hit
means the page was computed from exactly these tokens after a prefix with this digest; handing
back wrong KV would need two different prefixes with one SHA-256 digest, a collision no one has
ever found. A page is registered only once its tokens' KV is complete and final, and nothing
writes a registered page again: requests write only at positions past `num_computed_tokens`,
and a registered page lies wholly below it. An entry is dropped when its page is evicted, which
happens only to pages no request holds (`PageAllocator` keeps the references), so a pinned page
or one whose writes are in flight is never evicted. Unreferenced cached pages are evicted least
recently used first; a request frees its pages last page first, so a prefix's deeper pages go
before the pages they extend.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

ROOT = b""  # the parent digest of a request's first page


def cache_salt(model_id: str, kv_layout: str, page_size: int, dtype: str) -> bytes:
    """What makes two caches' digests comparable: the same weights, layout, page and dtype."""
    return hashlib.sha256(f"{model_id}|{kv_layout}|{page_size}|{dtype}".encode()).digest()


def page_digest(salt: bytes, parent: bytes, token_ids: tuple[int, ...]) -> bytes:
    """The digest of a page holding `token_ids` after the prefix digested as `parent`."""
    return hashlib.sha256(salt + parent + struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()


@dataclass(frozen=True, slots=True)
class CachedPage:
    """A registered page: what it holds and what it extends."""

    digest: bytes
    parent: bytes
    token_ids: tuple[int, ...]


class PrefixCache:
    """Digest -> page for full pages, and the LRU of those no request holds.

    >>> cache = PrefixCache(page_size=2, salt=b"s")
    >>> first = cache.register(7, ROOT, (1, 2))  # page 7 holds tokens 1, 2 of a prompt
    >>> cache.match([1, 2, 3, 4], max_pages=2)  # tokens 3, 4 were never registered
    [7]
    >>> cache.match([1, 5, 3, 4], max_pages=2)
    []
    """

    def __init__(self, page_size: int, salt: bytes = b"") -> None:
        self.page_size = page_size
        self.salt = salt
        self._by_digest: dict[bytes, int] = {}
        self._pages: dict[int, CachedPage] = {}
        self._unused: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self.queried_tokens = 0  # prompt tokens of admitted requests (`record_lookup`)
        self.hit_tokens = 0  # ... and found
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def num_evictable(self) -> int:
        """Cached pages no request holds: free for `PageAllocator.allocate`, after eviction."""
        return len(self._unused)

    def holds(self, page_id: int) -> bool:
        """Whether `page_id` is registered."""
        return page_id in self._pages

    def is_evictable(self, page_id: int) -> bool:
        """Whether `page_id` is cached and unreferenced."""
        return page_id in self._unused

    def match(self, token_ids: list[int], max_pages: int) -> list[int]:
        """The pages holding the longest cached prefix of `token_ids`, at most `max_pages`."""
        pages: list[int] = []
        parent = ROOT
        size = self.page_size
        for index in range(min(max_pages, len(token_ids) // size)):
            tokens = tuple(token_ids[index * size:(index + 1) * size])
            digest = page_digest(self.salt, parent, tokens)
            page_id = self._by_digest.get(digest)
            entry = self._pages.get(page_id) if page_id is not None else None
            if entry is None or entry.token_ids != tokens or entry.parent != parent:
                break
            pages.append(page_id)
            parent = digest
        return pages

    def register(self, page_id: int, parent: bytes, token_ids: tuple[int, ...]) -> bytes:
        """Register `page_id` as holding the full page `token_ids` after the prefix digested as
        `parent`; returns the page's digest. Registers nothing when another page holds this
        prefix already (two requests computed it at once) or `page_id` is registered."""
        assert len(token_ids) == self.page_size, f"{len(token_ids)} tokens is not a full page"
        digest = page_digest(self.salt, parent, token_ids)
        if digest not in self._by_digest and page_id not in self._pages:
            self._by_digest[digest] = page_id
            self._pages[page_id] = CachedPage(digest, parent, token_ids)
        return digest

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (for the hit rate)."""
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def digest_of(self, page_id: int) -> bytes:
        """The digest a registered page is known by."""
        return self._pages[page_id].digest

    # The allocator's side: which registered pages are unreferenced, and taking them back.

    def park(self, page_id: int) -> None:
        """The last request holding a registered page let go: it may be evicted from now."""
        self._unused[page_id] = None

    def unpark(self, page_id: int) -> None:
        """A request holds a parked page again (a hit): it may not be evicted."""
        del self._unused[page_id]

    def evict(self) -> int:
        """Forget the least recently used unreferenced page and return its id."""
        page_id, _ = self._unused.popitem(last=False)
        entry = self._pages.pop(page_id)
        del self._by_digest[entry.digest]
        self.evictions += 1
        return page_id

    def check_invariants(self) -> None:
        """Assert the two maps agree and every parked page is registered."""
        assert len(self._by_digest) == len(self._pages), "digest and page maps disagree"
        for page_id, entry in self._pages.items():
            assert self._by_digest[entry.digest] == page_id, f"page {page_id} is not indexed"
        assert set(self._unused) <= set(self._pages), "a parked page is not registered"
