"""The chunked-prefill scheduler: token budget, chunk sizes, mixing, preemption (S1, S3a)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.config import SchedulerConfig
from disagg.engine.page_allocator import PageAllocator
from disagg.engine.request import Request, RequestState, SamplingParams
from disagg.engine.scheduler import Scheduler
from disagg.errors import ConfigError, RequestError


def make_scheduler(num_pages: int = 64, page_size: int = 4, chunk_size: int = 8,
                   budget: int = 16, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             chunk_size=chunk_size)
    return Scheduler(config, PageAllocator(num_pages), page_size, max_model_len=4096)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 4) -> Request:
    return Request(request_id, list(range(1, num_prompt_tokens + 1)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_step(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule, pretend to run (sampling token 7), postprocess; return (id, start, len) chunks."""
    batch = scheduler.schedule()
    scheduler.postprocess(batch, {c.request.request_id: 7 for c in batch.chunks if c.samples})
    return [(c.request.request_id, c.start, c.num_tokens) for c in batch.chunks]


def test_long_prompt_is_chunked() -> None:
    """A 20-token prompt with chunk size 8 runs as 8 + 8 + 4, then decodes one token a step."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 20))
    assert [run_step(scheduler) for _ in range(4)] == [
        [("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)]]


def test_decodes_and_prefill_chunks_mix_under_the_budget() -> None:
    """A running decode goes first; a new prompt fills the rest of the token budget."""
    scheduler = make_scheduler(chunk_size=32, budget=10)
    scheduler.add_request(make_request("a", 3))
    run_step(scheduler)  # a's prefill
    scheduler.add_request(make_request("b", 30))
    assert run_step(scheduler) == [("a", 3, 1), ("b", 0, 9)]


def test_max_num_seqs_limits_admission() -> None:
    """No more than max_num_seqs requests run at once; the rest wait in order."""
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 2))
    assert [c[0] for c in run_step(scheduler)] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_out_of_pages_preempts_newest_and_recomputes() -> None:
    """When pages run out, the newest running request is preempted and later recomputed."""
    scheduler = make_scheduler(num_pages=4, page_size=2, chunk_size=8, budget=16)
    scheduler.add_request(make_request("a", 4, max_tokens=3))
    scheduler.add_request(make_request("b", 4, max_tokens=3))
    assert run_step(scheduler) == [("a", 0, 4), ("b", 0, 4)]  # all 4 pages in use
    assert run_step(scheduler) == [("a", 4, 1)]  # a needs a page: b is preempted
    b = scheduler.waiting[0]
    assert (b.request_id, b.state, b.num_computed_tokens, b.page_ids) == (
        "b", RequestState.WAITING, 0, [])
    while scheduler.has_unfinished():
        run_step(scheduler)
    scheduler.allocator.check_invariants(expect_all_free=True)


def test_pinned_requests_are_never_preempted() -> None:
    """A request whose pages are pinned (KV arriving) is not a preemption victim."""
    scheduler = make_scheduler(num_pages=4, page_size=2)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("b", 4))
    run_step(scheduler)
    a, b = scheduler.running
    scheduler.allocator.pin(b.page_ids)
    # a needs a fifth page; b is pinned, so a gives up its own pages rather than take b's,
    # and b then grows into one of them.
    assert run_step(scheduler) == [("b", 4, 1)]
    assert scheduler.running == [b]
    assert len(b.page_ids) == 3
    assert list(scheduler.waiting) == [a]
    assert a.page_ids == []


def test_a_prefiller_admits_a_request_only_with_all_its_pages_and_never_preempts() -> None:
    """Prefill-only: a prompt's pages are written out chunk by chunk while it is prefilled, so
    a running request must never lose them. A second prompt that would need them waits until
    the first is done, chunks of both never interleave into a preemption."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, chunk_size=4,
                             mode="prefill_only")
    scheduler = Scheduler(config, PageAllocator(6), page_size=2, max_model_len=4096)
    a, b = make_request("a", 10, max_tokens=1), make_request("b", 4, max_tokens=1)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert run_step(scheduler) == [("a", 0, 4)]  # b's 2 pages are not there: a holds 5 of 6
    assert len(a.page_ids) == 5 and list(scheduler.waiting) == [b]
    pages = list(a.page_ids)
    while a in scheduler.running:
        run_step(scheduler)
        assert a.page_ids == pages or a not in scheduler.running  # never taken from a
    assert a.state is RequestState.TRANSFERRING
    scheduler.allocator.free(a.page_ids)  # the messenger frees them once its writes are done
    a.page_ids = []
    assert run_step(scheduler) == [("b", 0, 4)]


def test_prompt_too_long_is_refused() -> None:
    """A request that can never fit in the cache is refused with a reason, not queued."""
    scheduler = make_scheduler(num_pages=2, page_size=4)
    with pytest.raises(RequestError, match="need 3 pages, the cache has 2"):
        scheduler.add_request(make_request("a", 9))
    assert not scheduler.has_unfinished()


def test_abort_frees_pages() -> None:
    """Aborting a running request frees its pages and marks it aborted."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    run_step(scheduler)
    request = scheduler.abort_request("a")
    assert request is not None
    assert request.state == RequestState.FINISHED_ABORTED
    scheduler.allocator.check_invariants(expect_all_free=True)
    assert scheduler.abort_request("a") is None


@settings(max_examples=40, deadline=None)
@given(prompt_lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       chunk_size=st.integers(1, 16), budget=st.integers(1, 32), num_pages=st.integers(16, 40))
def test_every_request_completes_within_limits(prompt_lens: list[int], chunk_size: int,
                                               budget: int, num_pages: int) -> None:
    """Whatever the limits, each step respects them and every request finishes, leak-free."""
    scheduler = make_scheduler(num_pages=num_pages, page_size=3, chunk_size=chunk_size,
                               budget=budget)
    requests = [make_request(str(i), n, max_tokens=3) for i, n in enumerate(prompt_lens)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(2000):
        if not scheduler.has_unfinished():
            break
        chunks = run_step(scheduler)
        assert sum(n for _, _, n in chunks) <= budget
        assert all(n <= chunk_size for _, _, n in chunks)
        assert len({name for name, _, _ in chunks}) == len(chunks)
        scheduler.allocator.check_invariants()
    assert all(r.state == RequestState.FINISHED_LENGTH and len(r.output_token_ids) == 3
               for r in requests)
    scheduler.allocator.check_invariants(expect_all_free=True)


@pytest.mark.parametrize("mode", ["decode_only", "prefill"])
def test_a_mode_the_scheduler_does_not_have_is_refused(mode: str) -> None:
    """Two modes exist (a decoder's engine is mixed); anything else is a ConfigError naming it,
    not a scheduler that silently runs mixed."""
    with pytest.raises(ConfigError, match=f"unknown scheduler mode '{mode}'"):
        SchedulerConfig(mode=mode)  # type: ignore[arg-type]
