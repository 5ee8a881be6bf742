"""The single-node engine loop: events per step, stop conditions, seeded sampling (S1)."""

from __future__ import annotations

import pytest

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import RequestState, SamplingParams
from disagg.model.loading.registry import init_random_weights


@pytest.fixture
def engine() -> LLMEngine:
    config = ModelConfig.from_name("tiny")
    engine_config = EngineConfig(config, CacheConfig(page_size=4, num_pages=64),
                                 SchedulerConfig(chunk_size=4, max_num_batched_tokens=8))
    return build_engine(engine_config, init_random_weights(config, seed=1))


def test_step_reports_every_generated_token(engine: LLMEngine) -> None:
    """The tokens reported by step() are exactly each request's outputs, in order."""
    requests = [engine.add_request(list(range(1, n)), SamplingParams(max_tokens=5,
                                                                     ignore_eos=True))
                for n in (3, 11)]
    reported: dict[str, list[int]] = {r.request_id: [] for r in requests}
    finished = []
    while engine.has_unfinished():
        for event in engine.step():
            reported[event.request.request_id].append(event.token_id)
            if event.finished:
                finished.append(event.request.request_id)
    assert reported == {r.request_id: r.output_token_ids for r in requests}
    assert all(len(tokens) == 5 for tokens in reported.values())
    assert sorted(finished) == sorted(reported)
    engine.allocator.check_invariants(expect_all_free=True)


def test_eos_stops_a_request(engine: LLMEngine) -> None:
    """A request stops at its first EOS unless told to ignore it."""
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    eos = greedy.output_token_ids[3]
    request = engine.add_request([5, 6, 7], SamplingParams(max_tokens=12))
    request.eos_token_ids = (eos,)
    while engine.has_unfinished():
        engine.step()
    first = greedy.output_token_ids.index(eos)
    assert request.output_token_ids == greedy.output_token_ids[:first + 1]
    assert request.state == RequestState.FINISHED_STOPPED
    engine.allocator.check_invariants(expect_all_free=True)


def test_seeded_sampling_is_reproducible(engine: LLMEngine) -> None:
    """The same seed gives the same sampled continuation, also when batched with others."""
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=42, ignore_eos=True)
    alone = engine.generate([[1, 2, 3]], params)[0].output_token_ids
    batched = engine.generate([[9, 9], [1, 2, 3]], params)[1].output_token_ids
    assert alone == batched
    engine.allocator.check_invariants(expect_all_free=True)
