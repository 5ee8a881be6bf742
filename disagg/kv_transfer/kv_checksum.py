"""The KV checksum a prefiller packs into the context slot and a decoder recomputes (S4c, S5, S6).

The decoder's guard against a counter that fired early (a duplicated immediate) or over pages
that were corrupted or misplaced. Each value counts with a weight drawn from its logical place
(layer, K or V or MLA's latent, token position, head, dim), so swapped pages, tokens or heads
change the sum, and the sum is over the values' bits in integers, so it is exact: any layout,
sharding, device or thread count gives the same number. It is not a cryptographic hash (that is
the nonce's job, `context_slot.py`); a decoder checks every rank's copy (`ReplicaSums`,
`agreed`).
On the CPU the weighted sum runs in C (`kv_lane_sum.c`, X8d); the PyTorch sum here is its
reference and the GPU's path.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

from disagg.model import cpu_kernels
from disagg.model.kv_cache import KVCache, PagedKVCache, PartRows

logger = logging.getLogger(__name__)

# The sum is kept mod 2^52: two checksums (the KV and the draft head's) add exactly in the
# float64 the context slot carries.
MASK = (1 << 52) - 1
_PRIME = 2147483647  # 2^31 - 1: a weight's state stays below it, its products below 2^48
_MULTIPLIER = 48271
DRAFT_SALT = 1  # the MTP head's cache: its layer 0 weighs unlike the model's layer 0


def _mix(x: torch.Tensor | int) -> torch.Tensor | int:
    """A step of a small integer hash, on ints below 2^32: a multiply mod 2^31 - 1, then an
    xor-shift (the multiply alone is linear, so equal-sum swaps could cancel)."""
    x = x * _MULTIPLIER % _PRIME
    return x ^ (x >> 11)


def _weights(seed: int, positions: torch.Tensor, heads: torch.Tensor, width: int
             ) -> torch.Tensor:
    """Odd weights in [1, 2^16), ``[num_heads, num_tokens, width]``: one per lane of each value
    at (position, head), from `seed` (salt, layer and K/V)."""
    lanes = torch.arange(width, device=positions.device)
    x = _mix(seed + positions)  # [num_tokens]
    x = _mix(x[None, :, None] + heads[:, None, None])  # [num_heads, num_tokens, 1]
    x = _mix(x + lanes)  # [num_heads, num_tokens, width]
    return ((x >> 7) & 0xFFFF) | 1


def _lanes(values: torch.Tensor) -> torch.Tensor:
    """The bits of ``[heads, tokens, head_dim]`` values as int64 lanes of 16 (or 8) bits:
    ``[heads, tokens, head_dim * lanes]``. Bits, not values: RDMA copies bytes, and integer
    sums do not depend on their order the way float sums do."""
    values = values.contiguous()
    small = torch.uint8 if values.element_size() == 1 else torch.int16
    return values.view(small).to(torch.int64)


def _weighted_sum(values: torch.Tensor, seed: int, positions: torch.Tensor,
                  head_ids: torch.Tensor) -> torch.Tensor:
    """The reference: the lanes of ``[heads, tokens, width]`` values, each times its weight,
    summed mod 2^52."""
    lanes = _lanes(values)  # [heads, num_tokens, width * lanes]
    # |int16 * weight| < 2^31: exact below 2^32 lanes per layer and rank.
    product = lanes * _weights(seed, positions, head_ids, lanes.shape[-1])
    return product.sum() & MASK


def _weighted_sum_kernel(values: torch.Tensor, seed: int, first_position: int,
                         head_ids: torch.Tensor) -> int:
    """`_weighted_sum` on the CPU in C (`kv_lane_sum.c`), of one contiguous array: the same
    number, with the weights drawn in registers instead of three tensors the size of the
    values. The checksum itself reads the pages in place (`_PartSum`); this is the
    entry the kernel's tests hold against the reference, any shape and dtype."""
    values = values.contiguous()
    lane_bytes = 1 if values.element_size() == 1 else 2
    heads, tokens = values.shape[0], values.shape[1]
    lanes = math.prod(values.shape[2:]) * values.element_size() // lane_bytes
    total = cpu_kernels.named_call(
        "disagg::kv_lane_sum", cpu_kernels.lib.kls_lane_sum, values.data_ptr(), lane_bytes,
        heads, tokens, lanes, head_ids.data_ptr(), first_position, seed,
        torch.get_num_threads())
    return total & MASK


@functools.lru_cache(maxsize=1 << 12)
def _seed(salt: int, layer: int, half: int) -> int:
    """The seed of one layer's part (K, V or the latent rows)."""
    return int(_mix(_mix(salt) + 2 * layer + half))


@functools.lru_cache(maxsize=64)
def _layer_seeds(num_layers: int, half: int, salt: int = 0) -> torch.Tensor:
    """Every layer's seed of one part, for `kls_layers_sum`; kept alive by the cache while
    the C call reads it."""
    return torch.tensor([_seed(salt, layer, half) for layer in range(num_layers)],
                        dtype=torch.int64)


@dataclass(frozen=True, slots=True)
class _PartSum:
    """One rank's part (K, V or the latent rows) of a token range as `kls_page_sum` reads it
    in place from the pages (no gather, no copy): where layer 0 holds it and every argument
    no layer changes; a layer adds its offset and seed."""

    half: int
    rows: PartRows
    head_ids: torch.Tensor  # kept alive: `args` holds its address
    args: tuple[int, ...]  # kls_page_sum's from page_size to first_position

    def layers_sum(self, layers: range, seeds: torch.Tensor, threads: int) -> int:
        """The parts of consecutive `layers` added, in one C call; `seeds`: every layer's."""
        if layers.step != 1 or not 0 <= layers.start <= layers.stop <= len(seeds):
            raise ValueError(f"{layers} is not a run of the cache's {len(seeds)} layers")
        stride = self.rows.layer_stride
        return cpu_kernels.named_call(
            "disagg::kv_page_sum", cpu_kernels.lib.kls_layers_sum,
            self.rows.addresses.data_ptr(), layers.start * stride, stride, len(layers),
            seeds.data_ptr() + seeds.element_size() * layers.start, *self.args, threads)


def _part_sums(shard: PagedKVCache, head_ids: torch.Tensor, pages: torch.Tensor,
               num_tokens: int, first_position: int, first_row: int = 0) -> list[_PartSum]:
    """Every part of one rank's pages, for tokens starting at row `first_row` of `pages`."""
    lane_bytes = 1 if shard.element_size == 1 else 2
    lanes = shard.head_dim * shard.element_size // lane_bytes
    parts = []
    for half in range(shard.kv_parts):
        rows = shard.part_rows(half, pages)
        parts.append(_PartSum(half, rows, head_ids, (
            shard.page_size, first_row, lane_bytes, len(head_ids), num_tokens, lanes,
            rows.head_stride, rows.token_stride, head_ids.data_ptr(), first_position)))
    return parts


def sums_in_place(kv_cache: KVCache) -> bool:
    """Whether the sums run in C on `kv_cache` (`LayerSums` needs it): in host memory, with
    the C kernels."""
    return cpu_kernels.ENABLED and kv_cache.device.type == "cpu"


class LayerSums:
    """The parts of `kv_checksum` over tokens [start, end) of `page_ids` (positions from the
    request's start; one copy of each head: `ranks`, by default the first replica set's),
    layer by layer, mod 2^52. The checksum is a sum, so a request's is these parts added over
    its layers and over any split of its tokens: a prefiller adds them as it posts each layer
    (`running_checksum.py`), a decoder over a request's body, then its last layer
    (`ReplicaSums`). What no layer changes (page addresses, strides, head ids) is found once,
    here; `over(layers)` is then one C call per rank and part, whatever the layers. CPU caches
    only (`sums_in_place`); one thread by default."""

    def __init__(self, kv_cache: KVCache, page_ids: list[int], start: int, end: int,
                 threads: int = 1, ranks: list[int] | None = None) -> None:
        size = kv_cache.page_size
        pages = torch.tensor(page_ids[start // size:-(-end // size)], dtype=torch.int64)
        sharding = kv_cache.sharding
        self._threads = threads
        self._num_layers = kv_cache.num_layers
        self._parts = [
            part for rank in (sharding.replica_sets()[0] if ranks is None else ranks)
            for part in _part_sums(kv_cache.shards[rank],
                                   torch.tensor(list(sharding.heads_of(rank)), dtype=torch.int64),
                                   pages, end - start, start, start % size)]

    def of(self, layer: int) -> int:
        """Layer `layer`'s part."""
        return self.over(range(layer, layer + 1))

    def over(self, layers: range) -> int:
        """The parts of consecutive `layers`, added."""
        return sum(part.layers_sum(layers, _layer_seeds(self._num_layers, part.half),
                                   self._threads) for part in self._parts) & MASK



class ReplicaSums:
    """`replica_sums` of one request's written pages over any range of layers, with what no
    layer changes found once: a decoder sums a request's body, then its last layer (X8d). In
    place on caches `sums_in_place` reads, else the PyTorch sum on each call."""

    def __init__(self, kv_cache: KVCache, page_ids: list[int], num_tokens: int,
                 first_page: int = 0) -> None:
        self._args = (kv_cache, page_ids, num_tokens, first_page)
        self._sets: list[LayerSums] | None = None
        if sums_in_place(kv_cache):
            start = first_page * kv_cache.page_size
            self._sets = [LayerSums(kv_cache, page_ids, start, max(start, num_tokens),
                                    torch.get_num_threads(), ranks)
                          for ranks in kv_cache.sharding.replica_sets()]

    def over(self, layers: range) -> list[int]:
        """Each replica set's sum over `layers`."""
        if self._sets is None:
            return replica_sums(*self._args, layers=layers)
        return [s.over(layers) for s in self._sets]


def _rank_sum(shard: PagedKVCache, heads: range, pages: torch.Tensor, num_tokens: int,
              first_position: int, salt: int, layers: range) -> torch.Tensor | int:
    """One rank's heads (global ids `heads`) of the tokens in `pages` in `layers`, summed
    mod 2^52."""
    device = shard.device
    positions = torch.arange(first_position, first_position + num_tokens, device=device)
    head_ids = torch.tensor(list(heads), dtype=torch.int64, device=device)
    if sums_in_place(shard):  # the pages read in place
        parts = _part_sums(shard, head_ids, pages, num_tokens, first_position)
        threads = torch.get_num_threads()
        return sum(part.layers_sum(layers, _layer_seeds(shard.num_layers, part.half, salt),
                                   threads) for part in parts) & MASK
    total = torch.zeros((), dtype=torch.int64, device=device)
    for layer in layers:
        for half, values in enumerate(shard.gather_parts(layer, pages, num_tokens)):
            total = (total + _weighted_sum(values, _seed(salt, layer, half), positions,
                                           head_ids)) & MASK  # one sync
    return total


def _set_sums(kv_cache: KVCache, page_ids: list[int], num_tokens: int, first_page: int,
              salt: int, replica_sets: list[list[int]], layers: range | None) -> list[int]:
    pages = torch.tensor(page_ids[first_page:], dtype=torch.int64, device=kv_cache.device)
    first_position = first_page * kv_cache.page_size
    num_tokens = max(0, num_tokens - first_position)
    sharding, shards = kv_cache.sharding, kv_cache.shards
    layers = range(kv_cache.num_layers) if layers is None else layers
    return [int(sum(_rank_sum(shards[rank], sharding.heads_of(rank), pages, num_tokens,
                              first_position, salt, layers) for rank in replica_set) & MASK)
            for replica_set in replica_sets]


def kv_checksum(kv_cache: KVCache, page_ids: list[int], num_tokens: int,
                first_page: int = 0, salt: int = 0) -> float:
    """The checksum of the first `num_tokens` tokens of `page_ids`, all layers and heads,
    leaving out the pages before `first_page` (those a decoder held already: prefix caching).

    It reads one copy of each head (the first replica set's): what a prefiller packs.
    Positions count from the request's start, so a held prefix shifts nothing, and a
    prefiller and a decoder holding the same KV compute the same number, whatever their
    layouts, shardings and devices.

    >>> from disagg.config import CacheConfig, ModelConfig
    >>> cache = PagedKVCache(ModelConfig.from_name("tiny"), CacheConfig(page_size=4, num_pages=8))
    >>> kv_checksum(cache, [3, 5], 6)  # zero pages
    0.0
    """
    first_set = kv_cache.sharding.replica_sets()[:1]
    return float(_set_sums(kv_cache, page_ids, num_tokens, first_page, salt, first_set,
                           None)[0])


def replica_sums(kv_cache: KVCache, page_ids: list[int], num_tokens: int, first_page: int = 0,
                 salt: int = 0, layers: range | None = None) -> list[int]:
    """`kv_checksum` of each replica set's copy (`Sharding.replica_sets`), in order, as
    integers mod 2^52, over `layers` only (None: all). Every rank is in one set, so together
    they read every copy of every head. The checksum is a sum over layers, so a decoder adds
    the sums of a request's body (every layer but the last), taken when the body landed, to
    its last layer's (X8d)."""
    return _set_sums(kv_cache, page_ids, num_tokens, first_page, salt,
                     kv_cache.sharding.replica_sets(), layers)


def agreed(kv_cache: KVCache, sums: list[int]) -> float:
    """The value of `replica_sums` every set agrees on, or NaN (which equals no prefiller's)
    if one differs: a decoder's check of every rank's copy, not only of each head's first
    holder."""
    if any(s != sums[0] for s in sums):
        logger.warning("KV copies disagree: checksums %s of replica sets %s", sums,
                       kv_cache.sharding.replica_sets())
        return float("nan")
    return float(sums[0])
