"""One request fails alone in a speculative step too (X5a): its verification, acceptance or
draft choice raising fails only it; the others keep the non-speculative greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import FailureCause, Request, RequestState, SamplingParams
from disagg.model.loading.registry import init_random_weights
from disagg.speculative import speculator as speculator_module
from disagg.speculative.speculator import Speculator, build_speculative_engine

CONFIG = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(CONFIG, seed=0)
GOOD = [[5, 6, 7, 8], [1, 2, 3], list(range(3, 20))]
BAD = [9, 10, 11, 12, 13]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)


def make_engine(speculative: bool = True) -> LLMEngine:
    config = EngineConfig(CONFIG, CacheConfig(page_size=4, num_pages=128),
                          SchedulerConfig(chunk_size=7, max_num_batched_tokens=32))
    if not speculative:
        return build_engine(config, WEIGHTS)
    return build_speculative_engine(config, WEIGHTS,
                                    SpeculativeConfig("early-exit", 2, draft_layers=1))


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The good requests' greedy tokens, without speculation and without the bad request."""
    return [r.output_token_ids for r in make_engine(speculative=False).generate(GOOD, PARAMS)]


def failing_on(bad: Request, after: int, inner: Callable[..., Any]) -> Callable[..., Any]:
    """`inner(..., request, ...)`, raising when called for `bad` the `after`-th time."""
    calls = {"n": 0}

    def wrapper(*args: Any) -> Any:
        if any(arg is bad or arg is bad.sampling_params for arg in args):
            calls["n"] += 1
            if calls["n"] == after:
                raise ZeroDivisionError("injected for one request")
        return inner(*args)
    return wrapper


def serve(engine: LLMEngine) -> tuple[list[Request], Request]:
    """Add the good requests around a bad one; the bad one, with params of its own."""
    good = [engine.add_request(prompt, PARAMS) for prompt in GOOD[:2]]
    bad = engine.add_request(BAD, SamplingParams(max_tokens=12, ignore_eos=True))
    return [*good, engine.add_request(GOOD[2], PARAMS)], bad


def finish(engine: LLMEngine, good: list[Request], bad: Request, reference: list[list[int]],
           what: str) -> None:
    """Run to the end: the bad request failed with its cause, the good ones are exact."""
    while engine.has_unfinished():
        for event in engine.step():
            assert event.request is not bad or bad.state is not RequestState.FINISHED_FAILED
    assert [r.output_token_ids for r in good] == reference
    assert bad.state is RequestState.FINISHED_FAILED and not bad.page_ids
    [failure] = engine.take_failures()
    assert failure.request is bad and failure.cause is FailureCause.ENGINE_ERROR
    assert failure.detail.startswith(f"{what} failed: ZeroDivisionError")
    engine.allocator.check_invariants(expect_all_free=True)


def test_a_verification_error_fails_that_request_alone(
        reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Verifying one request's drafts raises: it fails, the others keep their tokens."""
    engine = make_engine()
    good, bad = serve(engine)
    monkeypatch.setattr(Speculator, "_verify", failing_on(bad, 2, Speculator._verify))
    finish(engine, good, bad, reference, "verifying its drafts")


def test_an_accept_error_fails_that_request_alone(
        reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Accepting one request's verified tokens raises: it fails alone."""
    engine = make_engine()
    good, bad = serve(engine)
    scheduler = engine.scheduler
    monkeypatch.setattr(scheduler, "accept_tokens", failing_on(bad, 2, scheduler.accept_tokens))
    finish(engine, good, bad, reference, "accepting its drafts")


def test_a_draft_choice_error_fails_that_request_after_the_proposal(
        reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Choosing one request's draft raises inside the batched proposal: the proposal ends
    for the others, then that request fails."""
    engine = make_engine()
    good, bad = serve(engine)
    monkeypatch.setattr(speculator_module, "propose_token",
                        failing_on(bad, 3, speculator_module.propose_token))
    finish(engine, good, bad, reference, "choosing its draft")


def test_a_failed_proposal_fails_its_requests_and_the_engine_goes_on(
        reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The batched draft run raising is no one request's: those it drafted for fail, and
    requests added after it decode exactly."""
    engine = make_engine()
    spec = engine.finisher
    assert isinstance(spec, Speculator)
    propose, calls = spec.proposer.propose, {"n": 0}

    def failing_once(*args: Any) -> list[list[int]]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("draft forward failed (injected)")
        return propose(*args)

    monkeypatch.setattr(spec.proposer, "propose", failing_once)
    doomed = [engine.add_request(prompt, PARAMS) for prompt in GOOD]
    while calls["n"] < 2:
        engine.step()
    failed = [f.request for f in engine.take_failures()]
    assert failed and all(r.state is RequestState.FINISHED_FAILED for r in failed)
    assert set(map(id, failed)) <= set(map(id, doomed))
    while engine.has_unfinished():
        engine.step()
    after = [engine.add_request(prompt, PARAMS) for prompt in GOOD]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in after] == reference
    engine.allocator.check_invariants(expect_all_free=True)
