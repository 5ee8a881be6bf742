"""Sampling parameters and logprobs survive the control messages' flat fields (S2a, S8)."""

from __future__ import annotations

import pytest

from disagg.control.framing import decode, encode
from disagg.control.messages import RequestEvent, Submit
from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.logprobs import TokenLogprob
from disagg.engine.request import RequestState, SamplingParams
from disagg.errors import InvalidMessage, RequestError
from disagg.node.wire_sampling import event_logprobs, logprob_fields, sampling_params, submit_fields

EVERYTHING = SamplingParams(
    max_tokens=9, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop_token_ids=(4, 5),
    min_tokens=2, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3,
    logit_bias=((3, 2.5), (8, -100.0)), logprobs=4, n=3,
    guide=Guide(GuideKind.JSON_SCHEMA, '{"type": "object"}', strict=False))


@pytest.mark.parametrize("params", [SamplingParams(), EVERYTHING], ids=["defaults", "all"])
def test_sampling_params_round_trip_through_a_submit_frame(params: SamplingParams) -> None:
    message = decode(encode(Submit("r", [1, 2], **submit_fields(params))))
    assert sampling_params(message) == params


def test_a_bias_with_no_id_is_refused() -> None:
    message = Submit("r", [1], 4, logit_bias_ids=[3, 4], logit_bias_values=[1.0])
    with pytest.raises(RequestError, match="logit_bias"):
        sampling_params(message)


def test_an_unknown_guide_kind_is_refused_naming_the_kinds() -> None:
    with pytest.raises(RequestError, match="json_schema"):
        sampling_params(Submit("r", [1], 4, guide_kind="xml"))


def test_a_non_finite_logprob_is_refused_by_the_framing() -> None:
    frame = encode(RequestEvent("r", RequestState.RUNNING, [1], logprobs=[float("-inf")]))
    with pytest.raises(InvalidMessage, match="finite"):
        decode(frame)


def test_logprobs_round_trip_through_an_event_frame() -> None:
    logprob = TokenLogprob(7, -0.5, ((7, -0.5), (2, -1.25)))
    event = decode(encode(RequestEvent("r", RequestState.RUNNING, [7],
                                       **logprob_fields(logprob))))
    assert event_logprobs(event.token_ids, event.logprobs, event.top_logprob_ids,
                          event.top_logprobs) == [logprob]


def test_logprobs_that_do_not_match_the_tokens_are_refused() -> None:
    with pytest.raises(RequestError, match="do not match"):
        event_logprobs([1, 2], [-0.1], [], [])
