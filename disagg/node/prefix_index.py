"""The router's estimate of what each decoder has cached, for KV-aware routing (X2c).

The router never asks the decoders what they hold: it remembers, per decoder, the chained
digests of the whole pages of tokens it has sent there (prompts when routed, prompts plus
outputs when finished), in a bounded LRU. It is an estimate: a decoder may have evicted a page
since, and the router's pages line up with the decoder's only when `RoutingConfig.page_size`
is the decoders' page size. What it buys is locality: the turns of one conversation, and
requests sharing a system prompt, go where their prefix is.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from disagg.config import CacheConfig, check_choice, default_of
from disagg.engine.prefix_cache import ROOT, page_digest
from disagg.errors import ConfigError


class RoutingPolicy(enum.Enum):
    """How the router picks a decoder."""

    LEAST_LOADED = "least-loaded"  # the fewest requests in flight
    PREFIX = "prefix"  # the longest cached prefix, unless too loaded (then least-loaded)


ROUTING_POLICIES = tuple(p.value for p in RoutingPolicy)
PAGE_SIZE: int = default_of(CacheConfig, "page_size")  # best the decoders' own
LOAD_MARGIN = 4  # requests in flight beyond the least-loaded decoder a prefix may cost


def check_routing_policy(policy: str) -> RoutingPolicy:
    """The policy `policy` names (the CLI's word); a `ConfigError` naming an unknown one."""
    return RoutingPolicy(check_choice(policy, ROUTING_POLICIES, "routing policy"))


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The router's policy; `page_size` is best the decoders' page size."""

    policy: RoutingPolicy = RoutingPolicy.PREFIX
    load_margin: int = LOAD_MARGIN
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.load_margin < 0 or self.page_size < 1:
            raise ConfigError(f"routing: load_margin must be >= 0 and page_size >= 1, got "
                              f"{self.load_margin} and {self.page_size}")

    @staticmethod
    def parse(policy: str, load_margin: int = LOAD_MARGIN,
              page_size: int = PAGE_SIZE) -> RoutingConfig:
        """From the CLI's words; a `ConfigError` naming an unknown policy."""
        return RoutingConfig(check_routing_policy(policy), load_margin, page_size)


def page_digests(token_ids: list[int], page_size: int) -> list[bytes]:
    """Chained digests of the whole pages of `token_ids` (a partial last page has none)."""
    digests, parent = [], ROOT
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = page_digest(b"router", parent, tuple(token_ids[start:start + page_size]))
        digests.append(parent)
    return digests


class PrefixIndex:
    """Per decoder, the page digests it was sent, least recently used first."""

    def __init__(self, num_decoders: int, page_size: int = PAGE_SIZE,
                 capacity: int = 1 << 16) -> None:
        self.page_size = page_size
        self.capacity = capacity  # pages remembered per decoder
        self._pages: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_decoders)]

    def matched_tokens(self, decoder: int, digests: list[bytes]) -> int:
        """How many leading tokens of a prompt (given by its digests) `decoder` likely holds."""
        pages = self._pages[decoder]
        matched = 0
        for digest in digests:
            if digest not in pages:
                break
            matched += 1
        return matched * self.page_size

    def add(self, decoder: int, digests: list[bytes]) -> None:
        """`decoder` now holds these pages (most recently used)."""
        pages = self._pages[decoder]
        for digest in digests:
            pages[digest] = None
            pages.move_to_end(digest)
        while len(pages) > self.capacity:
            pages.popitem(last=False)

    def forget(self, decoder: int) -> None:
        """`decoder` died: whatever it held is gone."""
        self._pages[decoder].clear()


def pick_decoder(live: list[int], load: list[int], matched: list[int], margin: int) -> int:
    """The live decoder with the longest match, unless it has more than `margin` requests in
    flight beyond the least-loaded one; ties and no match at all go to the least loaded.

    >>> pick_decoder([0, 1, 2], load=[5, 1, 2], matched=[64, 0, 16], margin=4)
    0
    >>> pick_decoder([0, 1, 2], load=[6, 1, 2], matched=[64, 0, 16], margin=4)
    1
    """
    least = min(live, key=lambda i: load[i])
    best = max(live, key=lambda i: (matched[i], -load[i]))
    if matched[best] == 0 or load[best] - load[least] > margin:
        return least
    return best
