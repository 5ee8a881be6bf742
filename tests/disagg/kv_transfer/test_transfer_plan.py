"""The transfer planner: every destination byte exactly once, from the right source (S6, S7)."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.config import CacheConfig, ModelConfig
from disagg.kv_transfer.transfer_plan import (
    assign_source_sets,
    expected_write_count,
    pages_completed_by_chunk,
    plan_page_writes,
    plan_request,
)
from disagg.model.kv_cache import PagedKVCache
from disagg.model.page_geometry import PageGeometry
from disagg.model.sharding import Sharding


def logical_page(sharding: Sharding, rank: int, geometry: PageGeometry) -> np.ndarray:
    """A rank's page of a real `PagedKVCache`, each value naming its (kv, token, global head,
    dim), as the cache's bytes: the plan is checked against the layout the cache really has."""
    heads = list(sharding.heads_of(rank))
    model = replace(ModelConfig.from_name("tiny"), num_layers=1, num_heads=len(heads),
                    num_kv_heads=len(heads), head_dim=geometry.head_dim)
    cache = PagedKVCache(model, CacheConfig(geometry.page_size, 1, geometry.kv_layout))
    assert cache.element_size == geometry.element_size and cache.geometry == geometry
    kv, token, head, dim = torch.meshgrid(
        torch.arange(2), torch.arange(geometry.page_size), torch.tensor(heads),
        torch.arange(geometry.head_dim), indexing="ij")  # [2, page_size, heads, dim]
    values = ((kv * geometry.page_size + token) * sharding.num_kv_heads + head
              ) * geometry.head_dim + dim  # below 2^24: exact in float32
    slots = torch.arange(geometry.page_size)
    cache.write(0, values[0].float(), values[1].float(), torch.zeros_like(slots), slots)
    return cache.buffer.view(-1).view(torch.uint8).numpy().copy()


@st.composite
def shardings(draw: st.DrawFn) -> tuple[Sharding, Sharding, PageGeometry]:
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    degrees = [1, 2, 4, 8]
    src = Sharding(draw(st.sampled_from(degrees)), num_kv_heads, draw(st.booleans()))
    dst = Sharding(draw(st.sampled_from(degrees)), num_kv_heads, draw(st.booleans()))
    geometry = PageGeometry(draw(st.sampled_from(["NHD", "HND"])), draw(st.integers(1, 4)),
                            draw(st.sampled_from([2, 4, 6])), 4)
    return src, dst, geometry


@settings(max_examples=300, deadline=None)
@given(case=shardings(), seed=st.integers(0, 1000))
def test_plan_writes_every_destination_byte_once_with_the_right_value(
        case: tuple[Sharding, Sharding, PageGeometry], seed: int) -> None:
    """Applying the plan rebuilds each destination rank's page exactly, each byte once."""
    src, dst, geometry = case
    source_sets = assign_source_sets(src, dst, random.Random(seed))
    writes = plan_page_writes(src, dst, geometry, source_sets)
    sources = [logical_page(src, r, geometry).view(np.uint8).reshape(-1) for r in range(src.tp)]
    expected = [logical_page(dst, r, geometry).view(np.uint8).reshape(-1) for r in range(dst.tp)]
    received = [np.zeros_like(e) for e in expected]
    coverage = [np.zeros(e.shape, dtype=np.int64) for e in expected]
    for w in writes:
        received[w.dst_rank][w.dst_offset:w.dst_offset + w.nbytes] = \
            sources[w.src_rank][w.src_offset:w.src_offset + w.nbytes]
        coverage[w.dst_rank][w.dst_offset:w.dst_offset + w.nbytes] += 1
    for rank in range(dst.tp):
        assert (coverage[rank] == 1).all(), f"rank {rank}: bytes written {set(coverage[rank])}"
        assert np.array_equal(received[rank], expected[rank])
    assert len(writes) == len(plan_page_writes(src, dst, geometry))  # count is choice-free


@settings(max_examples=200, deadline=None)
@given(case=shardings())
def test_hnd_never_needs_more_writes_than_nhd(case: tuple[Sharding, Sharding, PageGeometry]
                                              ) -> None:
    """The same transfer in HND costs at most what it costs in NHD (S7)."""
    src, dst, geometry = case
    nhd = PageGeometry("NHD", geometry.page_size, geometry.head_dim, 4)
    hnd = PageGeometry("HND", geometry.page_size, geometry.head_dim, 4)
    assert len(plan_page_writes(src, dst, hnd)) <= len(plan_page_writes(src, dst, nhd))


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize(("tp", "num_kv_heads", "replicated"),
                         [(1, 4, False), (2, 4, False), (4, 4, False), (8, 4, False),
                          (4, 1, True)])
def test_matched_sharding_is_one_write_per_page_per_rank(kv_layout: str, tp: int,
                                                         num_kv_heads: int,
                                                         replicated: bool) -> None:
    """Same sharding on both sides: rank i sends its whole page to rank i, once."""
    sharding = Sharding(tp, num_kv_heads, replicated)
    writes = plan_page_writes(sharding, sharding, PageGeometry(kv_layout, 16, 8, 2))
    assert len(writes) == tp
    assert {(w.src_rank, w.dst_rank) for w in writes} == {(r, r) for r in range(tp)}


def test_tp8_page_costs_the_numbers_the_tutorial_quotes() -> None:
    """Prefill TP 1 -> decode TP 8, 8 KV heads, 16-token pages: 256 NHD writes, 16 HND."""
    src, dst = Sharding(1, 8), Sharding(8, 8)
    assert len(plan_page_writes(src, dst, PageGeometry("NHD", 16, 128, 2))) == 256
    assert len(plan_page_writes(src, dst, PageGeometry("HND", 16, 128, 2))) == 16


def test_replicated_sources_spread_over_all_ranks() -> None:
    """With a replicated prefiller, random assignment makes different ranks send (S6c)."""
    src, dst = Sharding(4, 1, replicated=True), Sharding(4, 1, replicated=True)
    senders = {w.src_rank for seed in range(20)
               for w in plan_page_writes(src, dst, PageGeometry("HND", 4, 4, 2),
                                         assign_source_sets(src, dst, random.Random(seed)))}
    assert senders == {0, 1, 2, 3}


@pytest.mark.parametrize("num_dst_sets", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("num_src_sets", [1, 2, 4])
def test_every_source_set_sends_in_every_call(num_src_sets: int, num_dst_sets: int) -> None:
    """Source sets come from a random permutation, not independent draws (S6c, S9a): with at
    least as many destination sets, every call uses every source set, each as evenly as can
    be; with fewer, no source set serves two destination sets."""
    src = Sharding(num_src_sets, 1, replicated=True)
    dst = Sharding(num_dst_sets, 1, replicated=True)
    first_choices = set()
    for seed in range(100):
        sets = assign_source_sets(src, dst, random.Random(seed))
        counts = [sets.count(i) for i in range(num_src_sets)]
        assert max(counts) - min(counts) <= 1, (seed, sets)
        first_choices.add(sets[0])
    assert first_choices == set(range(num_src_sets))  # still random: any set may go first


def test_fewer_destination_sets_get_distinct_sources() -> None:
    """Four source sets, two destination sets: two different senders, at random."""
    src, dst = Sharding(4, 1, replicated=True), Sharding(2, 1, replicated=True)
    draws = [assign_source_sets(src, dst, random.Random(seed)) for seed in range(100)]
    assert all(len(set(sets)) == 2 for sets in draws)
    assert {i for sets in draws for i in sets} == {0, 1, 2, 3}


def test_without_rng_set_j_serves_set_j() -> None:
    """No rng: deterministic, destination set j from source set j modulo the source sets."""
    src, dst = Sharding(2, 1, replicated=True), Sharding(5, 1, replicated=True)
    assert assign_source_sets(src, dst) == [0, 1, 0, 1, 0]
    assert assign_source_sets(Sharding(4, 4), Sharding(4, 4)) == [0]


@given(prompt_len=st.integers(2, 200), page_size=st.integers(1, 17),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_pages_are_sent_once_whatever_the_chunking(prompt_len: int, page_size: int,
                                                   chunks: list[int]) -> None:
    """Any chunking of the prefill sends each page exactly once, matching the expectation."""
    num_prefill, start, sent = prompt_len - 1, 0, []
    while start < num_prefill:
        end = min(num_prefill, start + chunks[len(sent) % len(chunks)])
        sent += list(pages_completed_by_chunk(start, end, num_prefill, page_size))
        start = end
    assert sent == list(range(-(-num_prefill // page_size)))
    assert expected_write_count(prompt_len, page_size, num_layers=3) == 3 * len(sent) + 1


def test_matched_tp_sends_rank_i_through_rank_is_domains() -> None:
    """S6a: TP 2 -> TP 2, each rank's writes go out through all of its own domains."""
    geometry = PageGeometry("HND", 4, 8, 4)
    writes = plan_request(Sharding(2, 4), Sharding(2, 4), geometry, random.Random(0),
                          [(0, 1), (2, 3)])
    assert {(w.src_rank, w.domains) for w in writes} == {(0, (0, 1)), (1, (2, 3))}


def test_replicated_sources_draw_one_domain_of_their_rank_per_request() -> None:
    """S9a: replicated KV to DP decoders: one source rank per request, one of its domains,
    and over many requests every rank and every domain is drawn."""
    geometry, rng = PageGeometry("HND", 4, 8, 4), random.Random(1)
    drawn = set()
    for _ in range(200):
        writes = plan_request(Sharding(2, 4, True), Sharding(1, 4, True), geometry, rng,
                              [(0, 1), (2, 3)])
        (rank,) = {w.src_rank for w in writes}
        (domains,) = {w.domains for w in writes}
        assert len(domains) == 1 and domains[0] in ((0, 1), (2, 3))[rank]
        drawn.add(domains[0])
    assert drawn == {0, 1, 2, 3}
