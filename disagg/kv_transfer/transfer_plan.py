"""Which pages to write after each chunk, and how many writes a decoder must expect (S3, S4c,
X2b).

A page is written once, when it is complete: either all its tokens are computed, or it holds
the last prefilled token. So the number of writes depends only on the prompt length, never on
how the prefiller chunked it, and the decoder can compute its expected count up front.
Writes per request = pages of the prefilled tokens x layers + one context write (S4a, S8),
counted under two immediate values: the body (every layer but the last) and the tail (the last
layer and the context), so a decoder can check the body while the tail is still computed.
With prefix caching the decoder says how many leading tokens (whole pages) it holds already;
those pages are never written, and the count drops by them. Pages the prefiller found in its
own cache are sent with the request's first chunk, as complete pages.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding
from transfer_core.memory import MemoryRegionDescriptor

CONTEXT_WRITES = 1  # the last prefilled position's hidden state (and checksum), one slot


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed for `num_tokens` tokens.

    >>> num_pages(17, 16)
    2
    """
    return -(-num_tokens // page_size)


def pages_completed_by_chunk(start: int, end: int, num_prefill_tokens: int,
                             page_size: int) -> range:
    """Indices (into the request's page list) of pages that become complete with tokens
    `[start, end)`: every page whose last slot is in the chunk, plus the final partial page
    when the chunk reaches the last prefilled token.

    >>> list(pages_completed_by_chunk(0, 5, 10, page_size=4))  # page 0 full; page 1 not yet
    [0]
    >>> list(pages_completed_by_chunk(5, 10, 10, page_size=4))  # page 1 full, page 2 is last
    [1, 2]
    """
    first = start // page_size  # pages before it were completed by earlier chunks
    if end >= num_prefill_tokens:
        return range(first, num_pages(num_prefill_tokens, page_size))
    return range(first, end // page_size)


def pages_to_send(num_sent: int, start: int, end: int, num_prefill_tokens: int,
                  page_size: int) -> range:
    """Indices of the pages to write after the forward of chunk `[start, end)`, when pages
    below `num_sent` were written (or are held by the decoder) already: every page up to the
    last one the chunk completes. The pages between `num_sent` and the chunk's start were
    found in the prefiller's cache; they go with the first chunk.

    >>> list(pages_to_send(0, 8, 10, 10, page_size=4))  # pages 0, 1 were cached here
    [0, 1, 2]
    >>> list(pages_to_send(2, 0, 10, 10, page_size=4))  # the decoder holds pages 0, 1
    [2]
    """
    return range(num_sent, pages_completed_by_chunk(start, end, num_prefill_tokens,
                                                    page_size).stop)


@dataclass(frozen=True, slots=True)
class ExpectedWrites:
    """A request's writes under each of its two immediates (S4c, X8d): `body`, its pages in
    every layer but the last; `tail`, its pages in the last layer plus what follows the forward
    (the context slot; a draft head's pages, added by the decoder that wants them)."""

    body: int
    tail: int

    @property
    def total(self) -> int:
        return self.body + self.tail

    def plus_tail(self, writes: int) -> ExpectedWrites:
        """With `writes` more in the tail."""
        return ExpectedWrites(self.body, self.tail + writes)


def expected_writes(num_prompt_tokens: int, page_size: int, num_layers: int,
                    page_writes: int = 1, num_cached_tokens: int = 0) -> ExpectedWrites:
    """`expected_write_count`, split between the body and the tail.

    >>> expected_writes(num_prompt_tokens=33, page_size=16, num_layers=30)  # 2 pages
    ExpectedWrites(body=58, tail=3)
    """
    num_prefill_tokens = num_prompt_tokens - 1
    if num_prefill_tokens <= num_cached_tokens:
        return ExpectedWrites(0, 0)
    pages = num_pages(num_prefill_tokens, page_size) - num_cached_tokens // page_size
    return ExpectedWrites(pages * (num_layers - 1) * page_writes,
                          pages * page_writes + CONTEXT_WRITES)


def expected_write_count(num_prompt_tokens: int, page_size: int, num_layers: int,
                         page_writes: int = 1, num_cached_tokens: int = 0) -> int:
    """Writes a decoder counts before a request is ready: the prefill covers every prompt
    token but the last (S8), `page_writes` writes per page per layer (1 when sharding matches;
    see `plan_page_writes`) for the pages after the `num_cached_tokens` the decoder holds
    (whole pages), plus the context write.

    >>> expected_write_count(num_prompt_tokens=33, page_size=16, num_layers=30)  # 2 pages
    61
    >>> expected_write_count(33, 16, 30, num_cached_tokens=16)  # the first page is held
    31
    """
    return expected_writes(num_prompt_tokens, page_size, num_layers, page_writes,
                           num_cached_tokens).total


# Sharded transfers (S6, S7): which bytes of a page go from which source rank to which
# destination rank.
#
# NOTE on the plan. A page of one layer, on a rank holding H heads, is K then V, each
# `[page_size, H, head_dim]` (NHD) or `[H, page_size, head_dim]` (HND). For every destination
# rank and every head it holds, the plan picks the source rank holding that head in the source
# replica set assigned to the destination's replica set, then merges neighbouring heads into
# runs and each run into contiguous byte ranges: a whole page when the run is every head on both
# sides, else one range per K/V half in HND, and one per token per half in NHD. Every
# destination byte is written exactly once, and the plan is the same for every page and layer,
# so the decoder's expected count is `len(plan) x pages x layers + 1`.


@dataclass(frozen=True, slots=True)
class PageWrite:
    """One contiguous write, as offsets inside a page of the source and destination ranks."""

    src_rank: int
    src_offset: int
    dst_rank: int
    dst_offset: int
    nbytes: int
    # The sender's transfer-engine domains (NICs) this write goes through; None: any.
    domains: tuple[int, ...] | None = None


def assign_source_sets(src: Sharding, dst: Sharding, rng: random.Random | None = None
                       ) -> list[int]:
    """For each destination replica set, the index of the source replica set serving it.

    With an `rng`, destination set j gets `perm[j % num_sources]` of a fresh random
    permutation of the source sets (S6c, S9a): with at least as many destination sets as
    source sets every source set sends, and the load differs by at most one set. Independent
    draws would leave some source sets idle. Without an `rng`, set j is served by set j modulo
    the number of source sets (with equal shardings: device i sends to device i, S6a).
    """
    order = list(range(len(src.replica_sets())))
    if rng is not None:
        rng.shuffle(order)  # a new order per call, so no source set is always first
    return [order[j % len(order)] for j in range(len(dst.replica_sets()))]


def plan_page_writes(src: Sharding, dst: Sharding, geometry: PageGeometry,
                     source_sets: list[int] | None = None) -> list[PageWrite]:
    """Every write that moves one page of one layer from the source to the destination ranks.

    >>> g = PageGeometry("NHD", page_size=16, head_dim=128, element_size=2)
    >>> len(plan_page_writes(Sharding(8, 8), Sharding(8, 8), g))  # matched: 1 per rank
    8
    >>> len(plan_page_writes(Sharding(1, 8), Sharding(8, 8), g))  # NHD, 1 -> 8: strided
    256
    >>> len(plan_page_writes(Sharding(1, 8), Sharding(8, 8), PageGeometry("HND", 16, 128, 2)))
    16
    """
    source_sets = source_sets or assign_source_sets(src, dst)
    src_sets = src.replica_sets()
    writes = []
    for set_index, dst_set in enumerate(dst.replica_sets()):
        source_set = src_sets[source_sets[set_index]]
        for dst_rank in dst_set:
            for src_rank, src_first, dst_first, count in _head_runs(src, dst, source_set,
                                                                    dst_rank):
                if count == src.heads_per_rank == dst.heads_per_rank:
                    # Every head of the page on both sides: the whole page in one write.
                    nbytes = geometry.page_nbytes(count)
                    writes.append(PageWrite(src_rank, 0, dst_rank, 0, nbytes))
                    continue
                src_segments = geometry.run_segments(src.heads_per_rank, src_first, count)
                dst_segments = geometry.run_segments(dst.heads_per_rank, dst_first, count)
                writes += [PageWrite(src_rank, s_off, dst_rank, d_off, nbytes)
                           for (s_off, nbytes), (d_off, _) in zip(src_segments, dst_segments,
                                                                   strict=True)]
    return writes


def plan_request(ours: Sharding, theirs: Sharding, geometry: PageGeometry,
                 rng: random.Random, rank_domains: Sequence[tuple[int, ...]] | None = None,
                 ) -> list[PageWrite]:
    """One request's page plan. Equal shardings: rank i to rank i (S6a); otherwise a random
    source replica set per destination set, so every source device sends (S6c).

    With `rank_domains` (rank r's transfer-engine domains: the NICs nearest its device), each
    write goes out through its source rank's own domains: all of them, striped, when TP is
    matched (S6a: more NICs, more bandwidth); one drawn at random per request and rank
    otherwise, so DP and replicated deployments spread requests over every NIC (S9a)."""
    matched = ours == theirs and not ours.replicated
    writes = plan_page_writes(ours, theirs, geometry,
                              assign_source_sets(ours, theirs, None if matched else rng))
    if rank_domains is None:
        return writes
    chosen = {rank: rank_domains[rank] if matched else (rng.choice(rank_domains[rank]),)
              for rank in sorted({w.src_rank for w in writes})}
    return [replace(w, domains=chosen[w.src_rank]) for w in writes]


def rank_descriptors(descriptors: Sequence[MemoryRegionDescriptor],
                     rank_domains: Sequence[tuple[int, ...]] | None
                     ) -> list[MemoryRegionDescriptor]:
    """Each rank's KV region as a decoder hands it out: rank r's descriptor names only rank
    r's own domains (its NICs), so every write into rank r's KV lands on one of rank r's
    endpoints (S5b, S6a). A sender's domain d writes to a descriptor's domain d modulo its
    count; with every domain of the node named, a prefiller whose domain count differs would
    reach rank r's KV through another rank's NIC. `rank_domains` None: every domain."""
    if rank_domains is None:
        return list(descriptors)
    if len(rank_domains) != len(descriptors):
        raise ValueError(f"{len(rank_domains)} ranks' domains for {len(descriptors)} regions")
    out = []
    for descriptor, domains in zip(descriptors, rank_domains, strict=True):
        if not domains or not all(0 <= d < len(descriptor.domains) for d in domains):
            raise ValueError(f"domains {domains} are not domains of region "
                             f"{descriptor.name!r} ({len(descriptor.domains)} of them)")
        out.append(replace(descriptor, domains=tuple(descriptor.domains[d] for d in domains)))
    return out


def _head_runs(src: Sharding, dst: Sharding, source_set: list[int], dst_rank: int
               ) -> list[tuple[int, int, int, int]]:
    """(src_rank, first src-local head, first dst-local head, count) runs for one rank."""
    runs: list[list[int]] = []
    for dst_local, head in enumerate(dst.heads_of(dst_rank)):
        src_rank = src.owner_in(source_set, head)
        src_local = src.heads_of(src_rank).index(head)
        last = runs[-1] if runs else None
        if (last and last[0] == src_rank and last[1] + last[3] == src_local
                and last[2] + last[3] == dst_local):
            last[3] += 1
        else:
            runs.append([src_rank, src_local, dst_local, 1])
    return [tuple(run) for run in runs]  # type: ignore[misc]


def writes_per_page(src: Sharding, dst: Sharding, geometry: PageGeometry) -> int:
    """How many writes one page of one layer costs (the same for any source-set choice)."""
    return len(plan_page_writes(src, dst, geometry))
