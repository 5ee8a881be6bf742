"""The router's estimate of what each decoder has cached, for KV-aware routing (X2c).

The router never asks the decoders what they hold: it remembers, per decoder, the chained
digests of the token blocks it has sent there (prompts when routed, prompts plus outputs when
finished), in a bounded LRU. It is an estimate: a decoder may have evicted a block since, and
the router's blocks need not line up with the decoder's pages. What it buys is locality: the
turns of one conversation, and requests sharing a system prompt, go where their prefix is.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from disagg.engine.prefix_cache import ROOT, page_digest
from disagg.errors import ConfigError


class RoutingPolicy(enum.Enum):
    """How the router picks a decoder."""

    LEAST_LOADED = "least-loaded"  # the fewest requests in flight
    PREFIX = "prefix"  # the longest cached prefix, unless too loaded (then least-loaded)


ROUTING_POLICIES = tuple(p.value for p in RoutingPolicy)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """The router's policy; `block_size` is best the decoders' page size."""

    policy: RoutingPolicy = RoutingPolicy.PREFIX
    load_margin: int = 4  # requests in flight beyond the least-loaded decoder a prefix may cost
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.load_margin < 0 or self.block_size < 1:
            raise ConfigError(f"routing: load_margin must be >= 0 and block_size >= 1, got "
                              f"{self.load_margin} and {self.block_size}")

    @staticmethod
    def parse(policy: str, load_margin: int = 4, block_size: int = 16) -> RoutingConfig:
        """From the CLI's words; a `ConfigError` naming an unknown policy."""
        if policy not in ROUTING_POLICIES:
            raise ConfigError(f"unknown routing policy {policy!r}: expected one of "
                              f"{ROUTING_POLICIES}")
        return RoutingConfig(RoutingPolicy(policy), load_margin, block_size)


def block_digests(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained digests of the whole blocks of `token_ids`."""
    digests, parent = [], ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = page_digest(b"router", parent, tuple(token_ids[start:start + block_size]))
        digests.append(parent)
    return digests


class PrefixIndex:
    """Per decoder, the block digests it was sent, least recently used first."""

    def __init__(self, num_decoders: int, block_size: int = 16, capacity: int = 1 << 16) -> None:
        self.block_size = block_size
        self.capacity = capacity  # blocks remembered per decoder
        self._blocks: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in range(num_decoders)]

    def matched_tokens(self, decoder: int, digests: list[bytes]) -> int:
        """How many leading tokens of a prompt (given by its digests) `decoder` likely holds."""
        blocks = self._blocks[decoder]
        matched = 0
        for digest in digests:
            if digest not in blocks:
                break
            matched += 1
        return matched * self.block_size

    def add(self, decoder: int, digests: list[bytes]) -> None:
        """`decoder` now holds these blocks (most recently used)."""
        blocks = self._blocks[decoder]
        for digest in digests:
            blocks[digest] = None
            blocks.move_to_end(digest)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def forget(self, decoder: int) -> None:
        """`decoder` died: whatever it held is gone."""
        self._blocks[decoder].clear()


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
