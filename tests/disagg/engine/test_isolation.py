"""One request fails alone (X5a): an exception while stepping one request fails it with its
cause, the others finish token-exact, every page comes back, the engine goes on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine import token_chooser
from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.isolation import MAX_FORWARD_FAILURES
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import FailureCause, Request, RequestState, SamplingParams
from disagg.engine.sampling import sample_token
from disagg.errors import GuideError, RankError
from disagg.model.loading.registry import init_random_weights

CONFIG = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(CONFIG, seed=1)
GOOD = [[5, 6, 7, 8], [1, 2, 3], list(range(3, 20))]
BAD = [9, 10, 11, 12, 13]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def make_engine(mode: str = "mixed") -> LLMEngine:
    return build_engine(EngineConfig(CONFIG, CacheConfig(page_size=4, num_pages=64),
                                     SchedulerConfig(chunk_size=4, max_num_batched_tokens=16,
                                                     mode=mode)), WEIGHTS)


def run_to_end(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until done; the tokens each request was told about, by id."""
    told: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for event in engine.step():
            told.setdefault(event.request.request_id, []).append(event.token_id)
    return told


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The good requests' tokens in a run without the bad one."""
    engine = make_engine()
    return [r.output_token_ids for r in engine.generate(GOOD, PARAMS)]


def raising_for(bad: SamplingParams, after: int, inner: Callable[..., Any]) -> Callable[..., Any]:
    """`inner`, raising for the request with params `bad` on its call number `after`."""
    calls = {"n": 0}

    def wrapper(*args: Any) -> Any:
        if any(arg is bad for arg in args):
            calls["n"] += 1
            if calls["n"] == after:
                raise ZeroDivisionError("injected for one request")
        return inner(*args)
    return wrapper


def check_failed_alone(engine: LLMEngine, good: list[Request], bad: Request,
                       reference: list[list[int]], what: str) -> None:
    """The bad request failed with its cause; the good ones match the reference."""
    told = run_to_end(engine)
    assert [r.output_token_ids for r in good] == reference
    assert [told[r.request_id] for r in good] == reference
    assert bad.state is RequestState.FINISHED_FAILED and not bad.page_ids
    [failure] = engine.take_failures()
    assert failure.request is bad and failure.cause is FailureCause.ENGINE_ERROR
    assert failure.detail == f"{what} failed: ZeroDivisionError: injected for one request"
    assert engine.take_failures() == []
    engine.allocator.check_invariants(expect_all_free=True)


def test_a_sampling_error_fails_that_request_alone(reference: list[list[int]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling raises for one request at its third token: it fails, the others finish."""
    engine = make_engine()
    bad_params = SamplingParams(max_tokens=8, ignore_eos=True)
    monkeypatch.setattr(token_chooser, "sample_token", raising_for(bad_params, 3, sample_token))
    good = [engine.add_request(prompt, PARAMS) for prompt in GOOD[:2]]
    bad = engine.add_request(BAD, bad_params)
    good.append(engine.add_request(GOOD[2], PARAMS))
    check_failed_alone(engine, good, bad, reference, "sampling")
    assert len(bad.output_token_ids) == 2  # what it had before the failure


def test_a_request_error_while_sampling_is_the_requests_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A RequestError (a grammar no token can follow, say) fails the request as invalid: its
    client gets a 400, not a server error; the other requests go on."""
    engine = make_engine()
    bad_params = SamplingParams(max_tokens=8, ignore_eos=True)

    def refusing(*args: Any) -> Any:
        if any(arg is bad_params for arg in args):
            raise GuideError("json: no token can follow")
        return sample_token(*args)

    monkeypatch.setattr(token_chooser, "sample_token", refusing)
    good = engine.add_request(GOOD[0], PARAMS)
    bad = engine.add_request(BAD, bad_params)
    run_to_end(engine)
    [failure] = engine.take_failures()
    assert failure.request is bad and failure.cause is FailureCause.INVALID_REQUEST
    assert "GuideError: json: no token can follow" in failure.detail
    assert good.state is not RequestState.FINISHED_FAILED


def test_a_stop_check_error_fails_that_request_alone(reference: list[list[int]],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Appending a token (the stop checks) raises for one request: it fails alone."""
    engine = make_engine()
    bad = engine.add_request(BAD, SamplingParams(max_tokens=8, ignore_eos=True))
    good = [engine.add_request(prompt, PARAMS) for prompt in GOOD]
    monkeypatch.setattr(Request, "append_token", _by_request(bad, 2, Request.append_token))
    check_failed_alone(engine, good, bad, reference, "appending its token")


def _by_request(bad: Request, after: int, inner: Callable[..., Any]) -> Callable[..., Any]:
    """`Request.append_token`, raising for `bad` on its call number `after`."""
    calls = {"n": 0}

    def wrapper(request: Request, token_id: int) -> None:
        if request is bad:
            calls["n"] += 1
            if calls["n"] == after:
                raise ZeroDivisionError("injected for one request")
        inner(request, token_id)
    return wrapper


def test_a_failed_forward_fails_its_batch_and_the_engine_goes_on(
        reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that raises is no one request's: its batch fails, later requests run."""
    engine = make_engine()
    doomed = [engine.add_request(prompt, PARAMS) for prompt in GOOD]
    execute = engine.runner.execute
    calls = {"n": 0}

    def failing_once(batch: Batch) -> ForwardOutput:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return execute(batch)

    monkeypatch.setattr(engine.runner, "execute", failing_once)
    while calls["n"] < 3:
        engine.step()
    assert all(r.state is RequestState.FINISHED_FAILED for r in doomed)
    failures = engine.take_failures()
    assert [f.request for f in failures] == doomed
    assert failures[0].detail == ("the batched forward failed: RuntimeError: CUDA out of "
                                  "memory (injected)")
    engine.allocator.check_invariants(expect_all_free=True)
    after = [engine.add_request(prompt, PARAMS) for prompt in GOOD]
    run_to_end(engine)
    assert [r.output_token_ids for r in after] == reference
    engine.allocator.check_invariants(expect_all_free=True)


def test_a_forward_that_keeps_failing_propagates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward failing means the node is broken: after a few, the error propagates."""
    engine = make_engine()

    def broken(batch: Batch) -> ForwardOutput:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    for _ in range(MAX_FORWARD_FAILURES - 1):
        engine.add_request(GOOD[0], PARAMS)
        engine.step()
    engine.add_request(GOOD[0], PARAMS)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


@pytest.mark.parametrize(("mode", "error"), [("mixed", RankError("TP rank 1 died")),
                                             ("prefill_only", RuntimeError("boom"))])
def test_a_dead_rank_or_a_prefiller_forward_propagates(
        mode: str, error: Exception, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dead TP rank stops any node at once; a prefiller isolates nothing (its pages may be
    read by RDMA writes already posted)."""
    engine = make_engine(mode)

    def raising(batch: Batch) -> ForwardOutput:
        raise error

    monkeypatch.setattr(engine.runner, "execute", raising)
    engine.add_request(GOOD[0], PARAMS)
    with pytest.raises(type(error)):
        engine.step()


def test_tiny_top_p_in_a_batch_is_greedy(reference: list[list[int]]) -> None:
    """The request that crashed the decoder (temperature 1, top_p 1e-300) now decodes its
    greedy tokens, next to the others."""
    engine = make_engine()
    crashing = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-300, seed=3,
                              ignore_eos=True)
    requests = [engine.add_request(prompt, crashing if i == 1 else PARAMS)
                for i, prompt in enumerate(GOOD)]
    run_to_end(engine)
    assert [r.output_token_ids for r in requests] == reference
    assert engine.take_failures() == []
