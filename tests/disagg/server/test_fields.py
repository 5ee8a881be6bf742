"""Every field the server accepts works or is a 400 naming it (`disagg.server.protocol`), and
text no tokenizer can take is a 400 naming its field, never a 500 (X5b)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import FailureCause, RequestState
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.errors import InvalidRequest
from disagg.server.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from tests.disagg.server.app_harness import FakeRouter, post, running_app

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}


def _parse(body: dict[str, Any]) -> Any:  # noqa: ANN401
    kind = ChatCompletionRequest if "messages" in body else CompletionRequest
    return parse_body(json.dumps(body).encode(), kind)


def _refused_param(body: dict[str, Any]) -> str | None:
    with pytest.raises(InvalidRequest) as caught:
        _parse(body)
    return caught.value.param


@pytest.mark.parametrize("extra", [
    {"logprobs": False}, {"logprobs": None}, {"logit_bias": {}}, {"logit_bias": None},
    {"n": None}, {"n": 1}, {"tools": []}, {"tools": None}, {"tool_choice": "none"},
    {"tool_choice": "auto"}, {"response_format": {"type": "text"}}, {"stream_options": None},
    {"stream": True, "stream_options": {"include_usage": True}}, {"top_logprobs": 0},
    {"presence_penalty": 0}, {"frequency_penalty": 0.0}, {"store": False},
    {"metadata": {"k": "v"}}, {"modalities": ["text"]}, {"parallel_tool_calls": True},
    {"min_p": 0}, {"repetition_penalty": 1}, {"seed": None}, {"stop": None}, {"user": None},
])
def test_off_values_are_accepted(extra: dict[str, Any]) -> None:
    """The API's own "off" values and explicit nulls change nothing, so they pass."""
    _parse({**CHAT, **extra})


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice.function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logit_bias": {"five": 10}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5"),
    ({"n": 17}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 0.1}, "min_p"),
    ({"stop_token_ids": [-3]}, "stop_token_ids.0"),
    ({"guided_choice": []}, "guided_choice"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities.1"),
    ({"store": True}, "store"),
])
def test_unimplemented_or_bad_values_are_refused_naming_the_field(extra: dict[str, Any],
                                                                  param: str) -> None:
    assert _refused_param({**CHAT, **extra}) == param


@pytest.mark.parametrize(("extra", "param"), [
    ({"logprobs": 21}, "logprobs"), ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
    ({"best_of": 2}, "best_of"), ({"stream_options": {"include_usage": True}},
                                  "stream_options")])
def test_completion_fields_refused_naming_the_field(extra: dict[str, Any], param: str) -> None:
    assert _refused_param({**COMPLETION, **extra}) == param


def test_the_sampling_fields_reach_the_decoder() -> None:
    """What the body asks the sampler for is what the decoder is sent (`Submit`)."""
    def script(message: Submit) -> list[RequestEvent]:
        return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [3])]

    body = {**COMPLETION, "logit_bias": {"5": 10, "7": -2.5}, "n": 2, "presence_penalty": 0.5,
            "frequency_penalty": -1, "repetition_penalty": 1.2, "min_tokens": 1,
            "stop_token_ids": [9], "logprobs": 3, "guided_regex": "[ab]+", "seed": 7}
    router = FakeRouter(script)
    with running_app(router) as (address, _):
        status, reply = post(address, "/v1/completions", body)
    assert status == 400 and reply["error"]["param"] == "guided_regex"  # tiny: no tokenizer
    del body["guided_regex"]
    with running_app(router) as (address, _):
        status, reply = post(address, "/v1/completions", body)
    assert status == 200, reply
    [sent] = router.submitted
    assert (sent.logit_bias_ids, sent.logit_bias_values) == ([5, 7], [10.0, -2.5])
    assert (sent.n, sent.presence_penalty, sent.frequency_penalty, sent.repetition_penalty,
            sent.min_tokens, sent.stop_token_ids, sent.logprobs, sent.seed) == (
                2, 0.5, -1.0, 1.2, 1, [9], 3, 7)
    assert [choice["index"] for choice in reply["choices"]] == [0, 1]


@pytest.mark.parametrize(("body", "param"), [
    ({**COMPLETION, "prompt": "a\udc80b"}, "prompt"),
    ({**COMPLETION, "prompt": ["\ud800"]}, "prompt[0]"),
    ({**CHAT, "messages": [{"role": "user", "content": "x\udc80"}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
    ({**CHAT, "stop": ["ok", "\udc80"]}, "stop[1]"),
])
def test_a_lone_surrogate_is_refused_naming_the_field(body: dict[str, Any], param: str) -> None:
    """JSON's `\\udc80` escape decodes to a lone surrogate (json.dumps writes it so)."""
    assert _refused_param(body) == param


def test_a_lone_surrogate_over_http_is_a_400_not_a_500(tiny_tokenizer: Tokenizer) -> None:
    router = FakeRouter(lambda m: [RequestEvent(m.request_id, RequestState.FINISHED_LENGTH,
                                                [3])])
    raw = b'{"model": "tiny", "prompt": "a\\udc80", "max_tokens": 1}'
    with running_app(router, tokenizer=tiny_tokenizer) as (address, _):
        status, reply = post(address, "/v1/completions", raw)
    assert status == 400
    assert reply["error"]["param"] == "prompt"
    assert router.submitted == []


def test_a_deeply_nested_body_is_a_400() -> None:
    raw = b'{"model": "tiny", "prompt": [1], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(InvalidRequest):
        parse_body(raw, CompletionRequest)


def test_explicit_nulls_and_off_values_serve_over_http() -> None:
    """The fields the issue found refused (`logprobs: false`, `logit_bias: {}`) now serve."""
    def script(message: Submit) -> list[RequestEvent]:
        return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [3])]

    body = {**COMPLETION, "logit_bias": {}, "n": None, "seed": None, "user": None}
    with running_app(FakeRouter(script)) as (address, _):
        status, reply = post(address, "/v1/completions", body)
    assert status == 200, reply


def test_a_failure_after_a_choice_ended_is_not_a_success() -> None:
    """n = 2: choice 0 ends, then the decoder dies (the router's failure names no choice):
    the answer is an error, never 200 with choice 1 missing."""
    def script(message: Submit) -> list[RequestEvent]:
        return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [3], index=0),
                RequestEvent(message.request_id, RequestState.RUNNING, [4], index=1),
                RequestEvent(message.request_id, RequestState.FINISHED_FAILED,
                             cause=FailureCause.DECODER_DIED, detail="decoder 0 died")]

    with running_app(FakeRouter(script)) as (address, _):
        status, reply = post(address, "/v1/completions", {**COMPLETION, "n": 2})
    assert status == 500 and reply["error"]["code"] == "decoder_died"

