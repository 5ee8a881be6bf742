"""Prefix caching in the single-node engine: the same tokens with and without it, fewer tokens
computed with it, and pages that stay safe under pressure and sharing."""

from __future__ import annotations

import random

import pytest

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import Request, SamplingParams
from disagg.model.loading.registry import init_random_weights

MODEL = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(MODEL, seed=3)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def make_engine(prefix_caching: bool = True, page_size: int = 4, num_pages: int = 64,
                kv_layout: str = "NHD", chunk_size: int = 8, budget: int = 8) -> LLMEngine:
    cache = CacheConfig(page_size=page_size, num_pages=num_pages, kv_layout=kv_layout,
                        prefix_caching=prefix_caching)
    config = EngineConfig(MODEL, cache, SchedulerConfig(chunk_size=chunk_size,
                                                        max_num_batched_tokens=budget))
    return build_engine(config, WEIGHTS)


def tokens_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, MODEL.vocab_size) for _ in range(length)]


def run(engine: LLMEngine, prompt: list[int]) -> Request:
    request = engine.generate([prompt], GREEDY)[0]
    engine.allocator.check_invariants(expect_all_free=True)
    return request


def computed_tokens(engine: LLMEngine, prompt: list[int]) -> tuple[Request, int]:
    """Serve `prompt` alone; the tokens the model ran over for it."""
    execute, rows = engine.runner.execute, []

    def counting(batch):  # noqa: ANN001, ANN202
        rows.append(batch.num_tokens)
        return execute(batch)

    engine.runner.execute = counting  # type: ignore[method-assign]
    try:
        return run(engine, prompt), sum(rows)
    finally:
        del engine.runner.execute


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size,shared", [(4, 10), (4, 12), (5, 13), (1, 7)])
def test_second_prompt_reuses_the_shared_pages_and_gets_the_same_tokens(
        kv_layout: str, page_size: int, shared: int) -> None:
    """Two prompts share `shared` tokens (ending mid-page or on a page edge): the second
    computes only what follows the shared whole pages, with the tokens of a cacheless run."""
    prefix = tokens_of(shared, seed=1)
    first, second = prefix + tokens_of(5, seed=2), prefix + tokens_of(7, seed=3)
    cold = make_engine(False, page_size, kv_layout=kv_layout)
    warm = make_engine(True, page_size, kv_layout=kv_layout)
    expected = [run(cold, p).output_token_ids for p in (first, second)]
    run(warm, first)
    request, computed = computed_tokens(warm, second)
    hit = shared // page_size * page_size
    assert request.num_cached_tokens == hit > 0
    assert computed == len(second) - hit + GREEDY.max_tokens - 1
    assert [run(make_engine(True, page_size, kv_layout=kv_layout), first).output_token_ids,
            request.output_token_ids] == expected


def test_without_prefix_caching_nothing_is_reused() -> None:
    engine = make_engine(prefix_caching=False)
    prompt = tokens_of(17, seed=4)
    run(engine, prompt)
    request, computed = computed_tokens(engine, prompt)
    assert request.num_cached_tokens == 0
    assert computed == len(prompt) + GREEDY.max_tokens - 1
    assert engine.allocator.cache is None


def test_the_same_prompt_again_still_computes_its_last_token() -> None:
    """A prompt cached whole: its last page is not taken, so the last token runs and samples."""
    engine = make_engine()
    prompt = tokens_of(16, seed=5)  # four whole pages
    first = run(engine, prompt)
    again, computed = computed_tokens(engine, prompt)
    assert again.num_cached_tokens == 12
    assert computed == 4 + GREEDY.max_tokens - 1
    assert again.output_token_ids == first.output_token_ids


def test_pages_filled_while_decoding_serve_the_next_turn() -> None:
    """A next turn's prompt is the last prompt plus its answer plus more: the answer's pages,
    computed by decode steps, are found too."""
    engine = make_engine()
    turn1 = tokens_of(9, seed=6)
    answer = run(engine, turn1).output_token_ids  # 9 + 6 tokens: 3 whole pages of 4
    turn2 = turn1 + answer + tokens_of(3, seed=7)
    request, _ = computed_tokens(engine, turn2)
    assert request.num_cached_tokens == 12
    assert request.output_token_ids == run(make_engine(False), turn2).output_token_ids


def test_a_prompt_arriving_while_its_prefix_is_prefilled_takes_the_pages_done_so_far() -> None:
    """Chunks of 8: after the first request's first chunk, a second request with the same
    prefix arrives and runs beside it; it finds two pages (the rest it computes itself, while
    the first computes the same tokens), and both get cacheless tokens."""
    engine = make_engine(chunk_size=8, budget=16)
    prefix = tokens_of(20, seed=8)
    a = engine.add_request(prefix + [5], GREEDY)
    engine.step()  # a's tokens 0..7: pages 0 and 1 complete and registered
    b = engine.add_request(prefix + [6, 7], GREEDY)
    engine.step()
    assert {c.request.request_id: c.start for c in engine.last_batch.chunks} == {
        a.request_id: 8, b.request_id: 8}
    while engine.has_unfinished():
        engine.step()
        engine.allocator.check_invariants()
    assert b.num_cached_tokens == 8
    cold = make_engine(False)
    assert [a.output_token_ids, b.output_token_ids] == [
        run(cold, prefix + [5]).output_token_ids, run(cold, prefix + [6, 7]).output_token_ids]
    engine.allocator.check_invariants(expect_all_free=True)


def test_eviction_under_pressure_never_takes_a_page_in_use() -> None:
    """A 24-page cache serving many prompts sharing a prefix at once: pages get evicted, and
    every step, each running request's pages are held by it (never parked) and tokens match
    a cacheless engine."""
    engine, cold = make_engine(num_pages=24), make_engine(False, num_pages=24)
    prefix = tokens_of(12, seed=9)
    prompts = [prefix + tokens_of(6 + i, seed=10 + i) if i % 2 else tokens_of(14, seed=30 + i)
               for i in range(10)]
    expected = [run(cold, p).output_token_ids for p in prompts]
    requests = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    pending = prompts[3:]
    while engine.has_unfinished() or pending:
        if pending and len(engine.scheduler.running) < 3:
            requests.append(engine.add_request(pending.pop(0), GREEDY))
        engine.step()
        cache = engine.allocator.cache
        assert cache is not None
        for request in engine.scheduler.running:
            for page in request.page_ids:
                assert engine.allocator.refcount(page) > 0 and not cache.is_evictable(page)
        engine.allocator.check_invariants()
    assert engine.allocator.cache.evictions > 0
    assert sum(r.num_cached_tokens for r in requests) > 0
    assert [r.output_token_ids for r in requests] == expected
    engine.allocator.check_invariants(expect_all_free=True)


def test_hits_and_queries_are_counted_in_tokens() -> None:
    engine = make_engine()
    prompt = tokens_of(10, seed=11)
    run(engine, prompt)
    run(engine, prompt + [3])
    cache = engine.allocator.cache
    assert cache is not None
    assert (cache.queried_tokens, cache.hit_tokens) == (10 + 11, 8)
