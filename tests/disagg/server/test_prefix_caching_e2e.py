"""Prefix caching through the HTTP API (X2): a conversation of three turns against a real
cluster (1 prefiller, 2 decoders, processes over libfabric), with and without the cache."""

from __future__ import annotations

import pytest

from disagg import load_model
from disagg.kv_transfer.context_slot import context_slot_nbytes
from disagg.kv_transfer.transfer_plan import num_pages
from tests.disagg.server.test_openai_e2e import (
    MODEL,
    Server,
    prompt_of,
    reference_tokens,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.fabric, pytest.mark.slow]
PAGE = 4  # start_server's --page-size
MAX_TOKENS = 6


def kv_bytes(server: Server) -> float:
    """KV bytes the decoders received so far, from their own series."""
    return sum(v for k, v in server.metrics().items() if k.startswith("disagg:kv_bytes_total"))


def converse(server: Server) -> list[tuple[list[int], list[int], int, float]]:
    """Three turns, each prompt the last one plus its answer plus 5 new tokens: per turn the
    prompt, the answer, usage's cached tokens and the KV bytes the turn moved."""
    prompt, turns = prompt_of(13, seed=1), []
    for turn in range(3):
        before = kv_bytes(server)
        reply = server.client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                                 max_tokens=MAX_TOKENS)
        answer = reply.choices[0].model_extra["token_ids"]
        cached = reply.usage.prompt_tokens_details.cached_tokens
        turns.append((prompt, answer, cached, kv_bytes(server) - before))
        prompt = prompt + answer + prompt_of(5, seed=10 + turn)
    return turns


def moved_bytes(prompt_len: int, cached: int) -> int:
    """What a turn's transfer weighs: the pages after the cached ones, every layer, + context."""
    config = load_model(MODEL).config
    page_nbytes = 2 * PAGE * config.num_kv_heads * config.head_dim * 4  # K and V, float32
    pages = num_pages(prompt_len - 1, PAGE) - cached // PAGE
    return pages * config.num_layers * page_nbytes + context_slot_nbytes(config)


def test_each_turn_finds_the_conversation_so_far_and_moves_only_its_new_pages() -> None:
    server = start_server("--prefillers", "1", "--decoders", "2")
    try:
        turns = converse(server)
        metrics = server.metrics()
    finally:
        stop_server(server)
    for index, (prompt, answer, cached, moved) in enumerate(turns):
        assert answer == reference_tokens(prompt, MAX_TOKENS), index
        if index:  # the last turn's prompt and answer, but the answer's last token
            last_prompt, last_answer = turns[index - 1][:2]
            held = (len(last_prompt) + len(last_answer) - 1) // PAGE * PAGE
            assert cached == min(held, (len(prompt) - 1) // PAGE * PAGE) > 0, index
        else:
            assert cached == 0
        assert moved == moved_bytes(len(prompt), cached), index
    hits = [v for k, v in metrics.items() if k.startswith("disagg:prefix_cache_hit_tokens_total")]
    assert sum(hits) >= turns[1][2] + turns[2][2]  # decoders' hits (and the prefiller's)
    assert metrics['disagg:prompt_tokens_cached_total{"model_name": "tiny"}'] == (
        turns[1][2] + turns[2][2])


def test_without_the_cache_every_turn_moves_every_page() -> None:
    server = start_server("--prefillers", "1", "--decoders", "2", "--no-prefix-caching")
    try:
        turns = converse(server)
    finally:
        stop_server(server)
    for prompt, answer, cached, moved in turns:
        assert answer == reference_tokens(prompt, MAX_TOKENS)
        assert cached == 0
        assert moved == moved_bytes(len(prompt), 0)
