"""`n` parallel samples on a real prefiller and decoder (X6c): one prefill and one transfer,
then `n` forks on the decoder, each reporting with its choice index; an abort frees every
fork's pages, and a request that fails before forking ends all its choices."""

from __future__ import annotations

import pytest

from disagg.control.messages import Abort, RequestEvent, Submit
from disagg.engine.request import RequestState
from tests.disagg.node.test_disagg_nodes import Pair, pair, wait_until  # noqa: F401

pytestmark = pytest.mark.fabric
PROMPT = list(range(3, 17))  # 14 tokens: with the tiny cache's pages, a partial last page


def events_of(pair: Pair, request_id: str, n: int) -> list[RequestEvent]:
    """Every event of `request_id` until each of its `n` choices ended."""
    events, ended = [], 0
    while ended < n:
        event = pair.router.events.get(timeout=30)
        assert event.request_id == request_id, event
        events.append(event)
        ended += event.state.is_terminal()
    return events


def tokens_by_choice(events: list[RequestEvent], n: int) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(n)]
    for event in events:
        tokens[event.index] += event.token_ids
    return tokens


def test_n_greedy_choices_are_one_prefill_and_one_transfer(pair: Pair) -> None:  # noqa: F811
    stats = pair.prefill.messenger.stats
    requests_before, writes_before = stats["requests"], stats["writes"]
    pair.router.route(Submit("one", PROMPT, 6, ignore_eos=True))
    [one] = tokens_by_choice(events_of(pair, "one", 1), 1)
    one_writes = stats["writes"] - writes_before
    pair.router.route(Submit("three", PROMPT, 6, ignore_eos=True, n=3))
    events = events_of(pair, "three", 3)
    assert tokens_by_choice(events, 3) == [one] * 3
    assert sorted(e.index for e in events if e.state.is_terminal()) == [0, 1, 2]
    # The prefiller counts a request when it reaps its writes' completions, which may come
    # after the decoder has decoded from them.
    wait_until(lambda: stats["requests"] - requests_before >= 2, "both transfers reaped")
    assert stats["requests"] - requests_before == 2  # one prefill each
    assert stats["writes"] - writes_before - one_writes <= one_writes  # prefix cache may help
    wait_until(lambda: pair.decode.engine.allocator.num_used == 0, "the forks' pages freed")


def test_seeded_choices_differ_and_choice_0_is_the_unforked_request(pair: Pair) -> None:  # noqa: F811
    pair.router.route(Submit("alone", PROMPT, 8, temperature=1.0, seed=9, ignore_eos=True))
    [alone] = tokens_by_choice(events_of(pair, "alone", 1), 1)
    pair.router.route(Submit("forked", PROMPT, 8, temperature=1.0, seed=9, ignore_eos=True,
                             n=3))
    forked = tokens_by_choice(events_of(pair, "forked", 3), 3)
    assert forked[0] == alone
    assert len({tuple(t) for t in forked}) == 3


def test_aborting_the_request_aborts_every_fork(pair: Pair) -> None:  # noqa: F811
    pair.router.route(Submit("long", PROMPT, 240, ignore_eos=True, n=3))
    seen: set[int] = set()
    while len(seen) < 3:  # every fork decoding
        event = pair.router.events.get(timeout=30)
        if event.token_ids:
            seen.add(event.index)
    pair.router.abort("long")
    ended = []
    while len(ended) < 3:
        event = pair.router.events.get(timeout=30)
        if event.state.is_terminal():
            ended.append(event)
    assert {e.state for e in ended} == {RequestState.FINISHED_ABORTED}
    assert sorted(e.index for e in ended) == [0, 1, 2]
    wait_until(lambda: pair.decode.engine.allocator.num_used == 0, "every fork's pages freed")


def test_aborting_one_choice_leaves_the_others(pair: Pair) -> None:  # noqa: F811
    pair.router.route(Submit("two", PROMPT, 60, ignore_eos=True, n=2))
    while not (event := pair.router.events.get(timeout=30)).token_ids:
        pass
    pair.router.decoders[0].send(Abort("two", 1))
    ends = {}
    while len(ends) < 2:
        event = pair.router.events.get(timeout=30)
        if event.state.is_terminal():
            ends[event.index] = event.state
    assert ends == {0: RequestState.FINISHED_LENGTH, 1: RequestState.FINISHED_ABORTED}
    wait_until(lambda: pair.decode.engine.allocator.num_used == 0, "both forks' pages freed")


def test_a_request_failing_before_it_forks_ends_every_choice(pair: Pair) -> None:  # noqa: F811
    """A refusal at admission is one failure (the router ends the request on it); a prompt
    too long for the cache fails there too."""
    pair.router.route(Submit("bad", PROMPT, 6, n=3, logit_bias_ids=[10**6],
                             logit_bias_values=[1.0]))
    event = pair.router.events.get(timeout=30)
    assert event.state is RequestState.FINISHED_FAILED and "logit_bias" in event.detail
    assert "bad" not in pair.router._owner


def test_a_fork_style_id_is_refused(pair: Pair) -> None:  # noqa: F811
    pair.router.route(Submit("a/1", PROMPT, 2))
    event = pair.router.events.get(timeout=30)
    assert event.state is RequestState.FINISHED_FAILED and "'/'" in event.detail
