"""Request and response ids are unique across front doors and restarts (uuid4), not counters
that every front door starts again at 0 (X5d)."""

from __future__ import annotations

import re

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from tests.disagg.server.app_harness import FakeRouter, post, running_app

BODY = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [3, 4])]


def _serve_twice() -> tuple[FakeRouter, list[str]]:
    """A fresh front door (as after a restart, or another replica) serving two requests."""
    router = FakeRouter(_answers)
    with running_app(router) as (address, _):
        ids = [post(address, "/v1/completions", BODY)[1]["id"] for _ in range(2)]
    return router, ids


def test_ids_differ_across_front_doors_and_requests() -> None:
    (first_router, first), (second_router, second) = _serve_twice(), _serve_twice()
    sent = [m.request_id for m in first_router.submitted + second_router.submitted]
    assert len(set(sent)) == 4
    assert len(set(first + second)) == 4


def test_response_id_is_the_prefix_and_the_routed_uuid() -> None:
    router, ids = _serve_twice()
    for response_id, message in zip(ids, router.submitted, strict=True):
        assert re.fullmatch(r"[0-9a-f]{32}", message.request_id)
        assert response_id == f"cmpl-{message.request_id}"
