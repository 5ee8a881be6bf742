"""What the routers hear of a request of `n` choices (X6c): each fork as its parent with its
index, one end per choice, the request released after the last."""

from __future__ import annotations

from typing import Any

from disagg.control.messages import RequestEvent
from disagg.engine.forking import fork_request_id
from disagg.engine.request import Request, RequestState, SamplingParams
from disagg.node.router_reports import RouterReports


class Channel:
    peer = "router"

    def __init__(self) -> None:
        self.sent: list[RequestEvent] = []

    def send(self, message: Any) -> None:  # noqa: ANN401
        self.sent.append(message)


def reports(ended: list[RequestState]) -> tuple[RouterReports, Channel]:
    reporter = RouterReports(lambda _: 0, lambda _request, state: ended.append(state))
    channel = Channel()
    reporter.owners.claim("r", channel)  # type: ignore[arg-type]
    reporter.opened("r", 3)
    return reporter, channel


def fork(index: int) -> Request:
    return Request(fork_request_id("r", index), [1, 2], SamplingParams(), parent_id="r",
                   index=index)


def test_forks_report_as_their_parent_and_it_ends_after_the_last() -> None:
    ended: list[RequestState] = []
    reporter, channel = reports(ended)
    for index in (1, 0):
        reporter.report(fork(index), RequestState.FINISHED_LENGTH, [7])
    assert [(e.request_id, e.index) for e in channel.sent] == [("r", 1), ("r", 0)]
    assert "r" in reporter.owners and not ended
    reporter.report(fork(2), RequestState.FINISHED_STOPPED, [2])
    assert "r" not in reporter.owners and ended == [RequestState.FINISHED_STOPPED]


def test_a_request_ending_before_it_forked_ends_every_choice() -> None:
    ended: list[RequestState] = []
    reporter, channel = reports(ended)
    parent = Request("r", [1, 2], SamplingParams(n=3))
    reporter.report(parent, RequestState.FINISHED_FAILED, detail="no KV")
    assert [e.index for e in channel.sent] == [0, 1, 2]
    assert "r" not in reporter.owners and ended == [RequestState.FINISHED_FAILED]


def test_a_failed_fork_says_its_siblings_must_stop() -> None:
    reporter, _ = reports([])
    assert reporter.report(fork(1), RequestState.FINISHED_FAILED) is True
    assert reporter.report(fork(0), RequestState.FINISHED_ABORTED) is False


def test_nothing_is_sent_for_a_released_request() -> None:
    reporter, channel = reports([])
    reporter.owners.release("r")
    reporter.report(fork(0), RequestState.RUNNING, [3])
    assert channel.sent == []
