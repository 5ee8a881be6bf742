"""A request whose step raises fails alone on a running decoder (X5a): its router hears
FINISHED_FAILED with cause engine_error, the other requests and the decoder go on."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.control.messages import RequestEvent, Submit
from disagg.engine import token_chooser
from disagg.engine.request import FailureCause, RequestState
from disagg.engine.sampling import sample_token
from disagg.node.router import Router
from tests.disagg.node.test_disagg_nodes import Pair, pair  # noqa: F401 (the fixture)

pytestmark = pytest.mark.fabric
MARK_TOP_K = 7  # the bad request's marker: sampling raises for it


def collect(router: Router, ids: set[str]) -> dict[str, tuple[list[int], RequestEvent]]:
    """Every request's tokens and terminal event."""
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    done: dict[str, tuple[list[int], RequestEvent]] = {}
    while len(done) < len(ids):
        event = router.events.get(timeout=30)
        tokens[event.request_id] += event.token_ids
        if event.state.is_terminal():
            done[event.request_id] = (tokens[event.request_id], event)
    return done


def test_tiny_top_p_decodes_greedy_tokens(pair: Pair) -> None:  # noqa: F811
    """temperature 1 with top_p 1e-300 killed the decoder; now it is the greedy output."""
    pair.router.route(Submit("greedy", [5, 6, 7, 8], 8, ignore_eos=True))
    pair.router.route(Submit("tiny", [5, 6, 7, 8], 8, temperature=1.0, top_p=1e-300,
                             ignore_eos=True))
    done = collect(pair.router, {"greedy", "tiny"})
    assert done["tiny"][1].state is RequestState.FINISHED_LENGTH
    assert done["tiny"][0] == done["greedy"][0]


def test_a_raising_request_fails_alone(pair: Pair, monkeypatch: pytest.MonkeyPatch  # noqa: F811
                                       ) -> None:
    """Sampling raises for one request: its client hears the failure and its cause; the
    request beside it finishes; the decoder serves the next one; nothing leaks (fixture)."""
    def sample(logits: Any, params: Any, generator: Any = None) -> int:
        if params.top_k == MARK_TOP_K:
            raise ZeroDivisionError("injected")
        return sample_token(logits, params, generator)

    monkeypatch.setattr(token_chooser, "sample_token", sample)
    pair.router.route(Submit("bad", [1, 2, 3], 8, top_k=MARK_TOP_K))
    pair.router.route(Submit("good", [4, 5, 6], 8, ignore_eos=True))
    done = collect(pair.router, {"bad", "good"})
    bad = done["bad"][1]
    assert (bad.state, bad.cause) == (RequestState.FINISHED_FAILED, FailureCause.ENGINE_ERROR)
    assert bad.detail == "sampling failed: ZeroDivisionError: injected"
    assert (done["good"][1].state, len(done["good"][0])) == (RequestState.FINISHED_LENGTH, 8)
    pair.router.route(Submit("next", [7, 8], 4, ignore_eos=True))
    assert collect(pair.router, {"next"})["next"][1].state is RequestState.FINISHED_LENGTH
