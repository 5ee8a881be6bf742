"""Prefix caching across the split (X2): the decoder asks only for the pages it lacks,
the prefiller computes only what it lacks and writes only what the decoder lacks, both count
the same writes, and the tokens are those of one engine without any cache."""

from __future__ import annotations

import pytest

from disagg.kv_transfer.messages import KVRequest
from disagg.kv_transfer.transfer_plan import expected_write_count, num_pages
from tests.disagg.kv_transfer.conftest import MakeHarness
from tests.disagg.kv_transfer.messenger_harness import (
    CACHE,
    Harness,
    random_prompt,
    single_node_tokens,
    tiny_model,
)

PAGE = CACHE.page_size
LAYERS = tiny_model().config.num_layers


def serve(h: Harness, prompt: list[int], request_id: str) -> tuple[list[int], KVRequest | None,
                                                                   int]:
    """One request to the end: its tokens, the KVRequest it sent (None: none), and the page
    writes the prefiller posted for it."""
    sent, writes = len(h.to_prefiller), h.prefill.stats["pages"]  # page writes, all layers
    request = h.submit(prompt, request_id)
    h.run_to_end(request)
    asks = [m for m in h.to_prefiller[sent:] if isinstance(m, KVRequest)]
    assert len(asks) <= 1
    return request.output_token_ids, (asks[0] if asks else None), (
        h.prefill.stats["pages"] - writes)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_a_second_turn_moves_only_its_new_pages(make_harness: MakeHarness,
                                                kv_layout: str) -> None:
    """Turn 2 = turn 1 + its answer + 6 tokens (24 tokens). The decoder holds turn 1's pages
    and the answer's full page (16 tokens), the prefiller its 12 prefilled tokens: it computes
    from token 12, and writes pages 4 and 5 only; both sides count those writes."""
    h = make_harness(kv_layout=kv_layout)
    turn1 = random_prompt(13, seed=1)
    answer, first_ask, first_writes = serve(h, turn1, "t1")
    assert first_ask is not None and first_ask.num_cached_tokens == 0
    turn2 = turn1 + answer + random_prompt(6, seed=2)
    tokens, ask, writes = serve(h, turn2, "t2")
    assert tokens == single_node_tokens(turn2)
    assert ask is not None and ask.num_cached_tokens == 16
    new_pages = num_pages(len(turn2) - 1, PAGE) - 16 // PAGE
    assert writes == new_pages * LAYERS == 2 * LAYERS  # pages 4, 5, every layer
    assert first_writes == num_pages(len(turn1) - 1, PAGE) * LAYERS
    receipt = h.outcomes[-1].receipt
    assert receipt is not None
    assert receipt.writes == expected_write_count(len(turn2), PAGE, LAYERS,
                                                  num_cached_tokens=16) == writes + 1
    prefill_cache = h.prefill_parts.allocator.cache
    assert prefill_cache is not None and prefill_cache.hit_tokens == 12
    h.check_clean()


def test_the_prefiller_sends_its_cached_pages_to_a_decoder_that_lacks_them(
        make_harness: MakeHarness) -> None:
    """A decoder without a cache asks twice for one prompt: the second time the prefiller
    computes only the last page's tokens and sends every page, the cached ones with the first
    chunk."""
    h = make_harness(decode_prefix_caching=False)
    prompt = random_prompt(18, seed=3)  # 17 prefilled tokens: 5 pages, 4 of them full
    for request_id in ("a", "b"):
        tokens, ask, writes = serve(h, prompt, request_id)
        assert tokens == single_node_tokens(prompt)
        assert ask is not None and ask.num_cached_tokens == 0
        assert writes == 5 * LAYERS
    prefill_cache = h.prefill_parts.allocator.cache
    assert prefill_cache is not None and prefill_cache.hit_tokens == 16
    h.check_clean()


def test_a_decoder_holding_all_but_the_last_token_asks_for_no_kv(
        make_harness: MakeHarness) -> None:
    """13 tokens: the 12 prefilled ones are three whole pages, which the decoder keeps; the
    same prompt again is not sent to the prefiller at all, and decodes the same tokens."""
    h = make_harness()
    prompt = random_prompt(13, seed=4)
    first, _, _ = serve(h, prompt, "a")
    again, ask, writes = serve(h, prompt, "b")
    assert (ask, writes) == (None, 0)
    assert again == first == single_node_tokens(prompt)
    h.check_clean()


def test_without_prefix_caching_every_page_moves_every_time(make_harness: MakeHarness) -> None:
    h = make_harness(prefill_prefix_caching=False, decode_prefix_caching=False)
    prompt = random_prompt(13, seed=5)
    for request_id in ("a", "b"):
        tokens, ask, writes = serve(h, prompt, request_id)
        assert ask is not None and ask.num_cached_tokens == 0
        assert writes == 3 * LAYERS
        assert tokens == single_node_tokens(prompt)
    h.check_clean()


def test_requests_sharing_a_prefix_in_flight_together_get_their_own_tokens(
        make_harness: MakeHarness) -> None:
    """Three requests sharing 10 tokens, submitted at once to a cold pair: whichever pages
    each side finds while the others are still being prefilled, every request decodes the
    single-node tokens and nothing is left behind."""
    h = make_harness()
    prefix = random_prompt(10, seed=6)
    prompts = [prefix + random_prompt(3 + i, seed=7 + i) for i in range(3)]
    requests = [h.submit(p, f"r{i}") for i, p in enumerate(prompts)]
    h.run_until(lambda: all(r.is_finished for r in requests) and h.idle())
    assert [r.output_token_ids for r in requests] == [single_node_tokens(p) for p in prompts]
    h.check_clean()


def test_a_bad_num_cached_tokens_is_refused_by_the_prefiller(make_harness: MakeHarness) -> None:
    """Not a whole number of pages, or not below the prefilled tokens: refused, nothing runs."""
    from disagg.errors import RequestError

    h = make_harness()
    assert h.peer is not None
    prompt = random_prompt(9, seed=8)
    for cached in (3, 8, -4):
        message = KVRequest("x", 7, 8, prompt, list(range(2)), 0, num_cached_tokens=cached)
        with pytest.raises(RequestError, match="num_cached_tokens"):
            h.prefill.start_request(message, h.peer)
    assert not h.prefill_engine.has_unfinished()
    h.check_clean()


def test_pages_whose_writes_are_in_flight_survive_any_eviction(make_harness: MakeHarness) -> None:
    """The prefiller found a request's first pages in its cache and is sending them: while the
    writes are parked, allocating every free page (evicting every cached page nobody holds)
    never hands out one of them, and once the writes land the request decodes right."""
    h = make_harness(decode_prefix_caching=False)
    prompt = random_prompt(18, seed=9)
    serve(h, prompt, "warm")  # the prefiller now caches 4 full pages of this prompt
    h.prefill_transfer.hold()
    request = h.submit(prompt, "r")
    h.run_until(lambda: not h.prefill_engine.has_unfinished() and h.prefill.num_in_flight == 1)
    (transfer,) = h.prefill._in_flight.values()
    allocator = h.prefill_parts.allocator
    in_flight = transfer.request.page_ids
    assert transfer.request.num_cached_tokens == 16 and h.prefill_transfer.held_writes() > 0
    taken = allocator.allocate(allocator.num_free)  # every empty page, every evictable one
    assert not set(taken) & set(in_flight)
    allocator.free(taken)
    h.prefill_transfer.release()
    h.run_to_end(request)
    assert request.output_token_ids == single_node_tokens(prompt)
    h.check_clean()
