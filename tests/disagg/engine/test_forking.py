"""`n` parallel samples forked from one prefill: each fork decodes as an unforked request would,
the prompt runs once, and every page is accounted for (`engine/forking.py`)."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from disagg.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from disagg.engine.forking import fork_seed
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import Request, RequestState, SamplingParams
from disagg.engine.scheduler import Scheduler
from disagg.errors import RequestError
from disagg.model.loading.registry import init_random_weights

MODEL = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(MODEL, seed=1)
PAGE = 5  # odd: prompts end anywhere in a page
# Cool enough that the tiny model's logits (spread ~1) decide tokens, not the seed alone: at
# temperature 1 its distribution is nearly flat and a wrong page barely moves a draw.
SEEDED = SamplingParams(max_tokens=10, temperature=0.1, seed=7, ignore_eos=True)


def make_engine(kv_layout: str = "NHD", prefix_caching: bool = False, copy: bool = True,
                num_pages: int = 64) -> LLMEngine:
    cache = CacheConfig(PAGE, num_pages, kv_layout, prefix_caching=prefix_caching)
    engine = build_engine(EngineConfig(MODEL, cache, SchedulerConfig(
        chunk_size=8, max_num_batched_tokens=16)), WEIGHTS)
    if not copy:  # a scheduler without a page copier (`EngineParts.build` always has one)
        engine.scheduler.copy_page = None
    return engine


def prompt(length: int) -> list[int]:
    return [(17 * i + 3) % MODEL.vocab_size for i in range(length)]


def run(engine: LLMEngine, parent: Request) -> list[Request]:
    """Step until nothing is left; the parent's forks, their pages all freed."""
    while engine.has_unfinished():
        engine.step()
    engine.allocator.check_invariants(expect_all_free=True)
    return parent.forks


def computed_tokens(engine: LLMEngine) -> int:
    """Step until nothing is left; the tokens every forward computed, summed."""
    computed = 0
    while engine.has_unfinished():
        steps = engine.num_steps
        engine.step()
        if engine.num_steps > steps and engine.last_batch is not None:
            computed += engine.last_batch.num_tokens
    return computed


def unforked(engine: LLMEngine, tokens: list[int], params: SamplingParams) -> list[int]:
    return engine.generate([tokens], params)[0].output_token_ids


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("length", [1, 3, 11, 13, 16], ids=lambda n: f"prompt{n}")
def test_greedy_forks_all_give_the_unforked_tokens(kv_layout: str, length: int) -> None:
    """n=3 greedy streams are the n=1 stream, whether the computed prompt ends inside a page
    (13: 12 computed, 2 in the last page), on a page boundary (11), or is empty (1)."""
    engine = make_engine(kv_layout)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want = unforked(engine, prompt(length), greedy)
    forks = run(engine, engine.add_request(prompt(length), replace(greedy, n=3)))
    assert [fork.output_token_ids for fork in forks] == [want] * 3


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("length", [12, 13], ids=lambda n: f"prompt{n}")
def test_seeded_forks_sample_as_unforked_requests_with_the_derived_seeds(kv_layout: str,
                                                                         length: int) -> None:
    """Fork 0 samples what the request would unforked, fork i what one seeded with
    `fork_seed(7, i)` would: so each fork's copy of the last page is exact (its 1 or 2
    computed tokens in every layer, K and V, and the slots each fork then writes alone)."""
    engine = make_engine(kv_layout)
    want = [unforked(engine, prompt(length), replace(SEEDED, seed=fork_seed(7, i)))
            for i in range(3)]
    forks = run(engine, engine.add_request(prompt(length), replace(SEEDED, n=3)))
    assert [fork.output_token_ids for fork in forks] == want
    assert len({tuple(tokens) for tokens in want}) == 3  # the streams differ: a real check


def test_forks_are_named_and_seeded_by_their_index() -> None:
    """Ids `parent/i`, OpenAI's choice index, n=1 each, fork 0 on the parent's seed."""
    engine = make_engine()
    parent = engine.add_request(prompt(13), replace(SEEDED, n=3), request_id="p")
    engine.step()
    engine.step()  # 12 tokens: 8, then 4; the next schedule forks
    assert engine.scheduler.forks_of("p") == []
    engine.step()
    forks = engine.scheduler.forks_of("p")
    assert [(f.request_id, f.parent_id, f.index) for f in forks] == [
        ("p/0", "p", 0), ("p/1", "p", 1), ("p/2", "p", 2)]
    assert [f.sampling_params.n for f in forks] == [1, 1, 1]
    assert [f.sampling_params.seed for f in forks] == [7, fork_seed(7, 1), fork_seed(7, 2)]
    assert parent.state is RequestState.FINISHED_FORKED
    assert parent.page_ids == []
    assert {event.request.request_id for event in engine.step()} == {"p/0", "p/1", "p/2"}
    run(engine, parent)
    assert engine.scheduler.forks_of("p") == []


def test_forks_carry_the_parents_trace_context() -> None:
    """A fork's spans join its request's trace (X7a): it inherits the span context."""
    engine = make_engine()
    parent = engine.add_request(prompt(13), replace(SEEDED, n=2), request_id="p")
    parent.traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    for _ in range(3):
        engine.step()
    assert {f.traceparent for f in engine.scheduler.forks_of("p")} == {parent.traceparent}
    run(engine, parent)


def test_the_prompt_is_computed_once() -> None:
    """13 prompt tokens, n=3, 10 tokens each: 12 prompt tokens once, then every fork runs the
    last prompt token and 9 decodes (3 x 13 + 3 x 9 = 66 unforked)."""
    engine = make_engine()
    parent = engine.add_request(prompt(13), replace(SEEDED, n=3))
    computed = computed_tokens(engine)
    assert computed == 12 + 3 * 10
    assert all(len(fork.output_token_ids) == 10 for fork in parent.forks)


def test_without_a_page_copier_forks_compute_the_last_page_again() -> None:
    """With no `copy_page` wired, forks 1 and 2 share the full pages only and recompute the 2
    tokens of the last one: the same tokens, 4 more computed."""
    engine = make_engine(copy=False)
    want = [unforked(engine, prompt(13), replace(SEEDED, seed=fork_seed(7, i)))
            for i in range(3)]
    parent = engine.add_request(prompt(13), replace(SEEDED, n=3))
    computed = computed_tokens(engine)
    assert [fork.output_token_ids for fork in parent.forks] == want
    assert computed == 12 + 2 * 2 + 3 * 10
    engine.allocator.check_invariants(expect_all_free=True)


def test_shared_pages_are_held_once_per_fork() -> None:
    """While they decode, 3 forks hold the 2 full prompt pages 3 times; the last page is
    fork 0's and one copy each for the others."""
    engine = make_engine()
    parent = engine.add_request(prompt(13), replace(SEEDED, n=3))
    while not parent.forks:
        engine.step()
    allocator = engine.allocator
    shared = parent.forks[0].page_ids[:2]
    assert all(fork.page_ids[:2] == shared for fork in parent.forks)
    assert [allocator.refcount(p) for p in shared] == [3, 3]
    tails = [fork.page_ids[2] for fork in parent.forks]
    assert len(set(tails)) == 3
    assert [allocator.refcount(p) for p in tails] == [1, 1, 1]
    assert allocator.num_used == 5
    run(engine, parent)


def test_aborting_the_parent_mid_decode_frees_every_fork() -> None:
    """The parent's id aborts every live fork; no page stays held."""
    engine = make_engine()
    parent = engine.add_request(prompt(13), replace(SEEDED, n=3), request_id="p")
    while not parent.forks or not parent.forks[0].output_token_ids:
        engine.step()
    engine.step()
    assert engine.scheduler.abort_request("p") is parent
    assert parent.state is RequestState.FINISHED_ABORTED
    assert [f.state for f in parent.forks] == [RequestState.FINISHED_ABORTED] * 3
    assert not engine.has_unfinished()
    assert engine.scheduler.forks_of("p") == []
    engine.allocator.check_invariants(expect_all_free=True)


def test_a_fork_that_stops_early_frees_only_its_own_references() -> None:
    """Fork 1 samples an EOS at its 3rd token (the others never do): its copy of the last
    page goes, the full pages stay held by the other two until they finish."""
    engine = make_engine()
    seeded = [unforked(engine, prompt(13), replace(SEEDED, seed=fork_seed(7, i)))
              for i in range(3)]
    eos = seeded[1][2]
    assert eos not in seeded[1][:2] + seeded[0] + seeded[2], "pick another prompt or seed"
    parent = engine.add_request(prompt(13), replace(SEEDED, n=3, ignore_eos=False))
    parent.eos_token_ids = (eos,)
    while not parent.forks or not parent.forks[1].is_finished:
        engine.step()
    first, stopped, third = parent.forks
    assert stopped.state is RequestState.FINISHED_STOPPED
    assert stopped.page_ids == []
    assert [engine.allocator.refcount(p) for p in first.page_ids[:2]] == [2, 2]
    assert engine.allocator.num_used == len(set(first.page_ids) | set(third.page_ids))
    run(engine, parent)
    assert [first.output_token_ids, third.output_token_ids] == [seeded[0], seeded[2]]


def test_forks_keep_the_prefix_cache_consistent() -> None:
    """With prefix caching the forks carry the parent's digests of the shared pages; the
    cache balances after them, and the same prompt later hits and decodes the same."""
    engine = make_engine(prefix_caching=True)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    parent = engine.add_request(prompt(13), replace(greedy, n=3))
    while not parent.forks:
        engine.step()
    digests = parent.forks[0].page_digests
    assert len(digests) == 2
    assert all(f.page_digests == digests for f in parent.forks)
    forks = run(engine, parent)
    again = engine.generate([prompt(13)], greedy)[0]
    assert again.num_cached_tokens == 10
    assert all(fork.output_token_ids == again.output_token_ids for fork in forks)
    engine.allocator.check_invariants(expect_all_free=True)


def test_a_prompt_cached_but_its_last_token_forks_at_admission() -> None:
    """11 tokens, 10 of them cached: nothing to prefill, so the forks wait in the parent's
    place and each takes the 2 cached pages (held 3 times)."""
    engine = make_engine(prefix_caching=True)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    want = engine.generate([prompt(11)], greedy)[0].output_token_ids
    parent = engine.add_request(prompt(11), replace(greedy, n=3))
    engine.step()
    assert len(parent.forks) == 3
    assert all(f.num_cached_tokens == 10 for f in parent.forks)
    assert [engine.allocator.refcount(p) for p in parent.forks[0].page_ids[:2]] == [3, 3]
    assert [fork.output_token_ids for fork in run(engine, parent)] == [want] * 3


def make_scheduler(num_pages: int = 16, max_num_seqs: int = 8,
                   copies: list[tuple[int, int]] | None = None) -> Scheduler:
    copy = None if copies is None else lambda src, dst: copies.append((src, dst))
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs), PageAllocator(num_pages), 4,
                     max_model_len=4096, copy_page=copy)


def test_a_request_prefilled_elsewhere_forks_at_the_next_schedule() -> None:
    """A decoder's request arrives with every prompt token but the last (S8): the next batch
    runs that token once per fork, two of them on copies of the last page."""
    copies: list[tuple[int, int]] = []
    scheduler = make_scheduler(copies=copies)
    request = Request("p", list(range(1, 11)), SamplingParams(n=3, ignore_eos=True))
    request.page_ids = scheduler.allocator.allocate(3)  # 10 tokens; 9 arrived
    request.num_computed_tokens = 9
    scheduler.add_prefilled(request)
    batch = scheduler.schedule()
    assert [(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks] == [
        ("p/0", 9, 1), ("p/1", 9, 1), ("p/2", 9, 1)]
    tails = [chunk.request.page_ids[2] for chunk in batch.chunks]
    assert copies == [(tails[0], tails[1]), (tails[0], tails[2])]
    assert scheduler.abort_request("p") is request
    scheduler.allocator.check_invariants(expect_all_free=True)


def test_on_fork_is_told_the_parent_and_its_forks_once() -> None:
    """The hook hears of the forks before any of them samples, once per forked request."""
    forked: list[tuple[str, list[str]]] = []
    scheduler = make_scheduler()
    scheduler.on_fork = lambda parent, forks: forked.append(
        (parent.request_id, [fork.request_id for fork in forks]))
    scheduler.add_request(Request("p", [1, 2, 3], SamplingParams(n=2, ignore_eos=True)))
    scheduler.postprocess(scheduler.schedule(), {})  # the 2 tokens before the last
    assert forked == []
    batch = scheduler.schedule()
    assert forked == [("p", ["p/0", "p/1"])]
    scheduler.postprocess(batch, {"p/0": 5, "p/1": 6})
    scheduler.schedule()
    assert len(forked) == 1


def test_a_request_to_fork_counts_as_n_sequences() -> None:
    """With 4 sequences a step, n=3 and one more request run; a third waits."""
    scheduler = make_scheduler(max_num_seqs=4)
    for request_id, n in (("a", 3), ("b", 1), ("c", 1)):
        scheduler.add_request(Request(request_id, [1, 2, 3], SamplingParams(n=n)))
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_samples_that_could_never_fit_are_refused() -> None:
    """n streams need the prompt's full pages once and their own pages n times; n may not
    exceed the sequences a step holds."""
    scheduler = make_scheduler(num_pages=8)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    scheduler.check_fits(Request("fits", list(range(9)), replace(params, n=3)))  # 4 + 2 x 2
    with pytest.raises(RequestError, match="x 4 samples need 10 pages"):
        scheduler.check_fits(Request("big", list(range(9)), replace(params, n=4)))
    with pytest.raises(RequestError, match="n=9 samples exceed the 8 sequences"):
        make_scheduler().check_fits(Request("many", [1], SamplingParams(n=9)))


def test_forks_short_of_pages_are_preempted_and_still_decode_right(
        caplog: pytest.LogCaptureFixture) -> None:
    """12 pages for n=3 (11 pages) beside another request (5): forks are preempted and
    recomputed, and every stream still gets the unforked greedy tokens."""
    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    want = unforked(make_engine(), prompt(13), greedy)
    engine = make_engine(num_pages=12)
    other = engine.add_request(prompt(13), greedy)  # older: the forks make room for it
    parent = engine.add_request(prompt(13), replace(greedy, n=3), request_id="p")
    with caplog.at_level(logging.INFO, logger="disagg.engine.scheduler"):
        forks = run(engine, parent)
    assert "preempting p/" in caplog.text
    assert [fork.output_token_ids for fork in forks] + [other.output_token_ids] == [want] * 4
