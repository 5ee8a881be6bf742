"""The HTTP layer over a scripted router: stop strings, admission (429), no decoder (503),
failures mid-stream, and the abort sent when a request ends early."""

from __future__ import annotations

import json
import threading
import time

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import FailureCause, RequestState
from disagg.model.loading.tokenizer import Tokenizer
from tests.disagg.server.app_harness import FakeRouter, post, running_app

WORDS = ["<eos>", "hello", "world", "STOP", "after", "ST", "OP"]


def word_tokenizer() -> Tokenizer:
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return Tokenizer(backend, None, (0,))


def words(*names: str) -> list[int]:
    return [WORDS.index(n) for n in names]


def script_of(*steps: tuple[list[int], RequestState]) -> callable:
    def script(message: Submit) -> list[RequestEvent]:
        return [RequestEvent(message.request_id, state, ids) for ids, state in steps]
    return script


RUN, LENGTH = RequestState.RUNNING, RequestState.FINISHED_LENGTH
BODY = {"model": "tiny", "prompt": [1, 2], "max_tokens": 8}


def test_a_stop_string_cuts_the_text_and_aborts_the_request() -> None:
    router = FakeRouter(script_of((words("hello", "world"), RUN), (words("STOP"), RUN),
                                  (words("after"), LENGTH)))
    with running_app(router, tokenizer=word_tokenizer()) as (address, _):
        status, reply = post(address, "/v1/completions", {**BODY, "stop": ["STOP"]})
    assert status == 200
    assert reply["choices"][0]["text"] == "hello world "
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert router.aborted == [router.submitted[0].request_id]


def test_a_stop_string_split_over_tokens_is_held_back_then_cut() -> None:
    router = FakeRouter(script_of((words("hello", "ST"), RUN), (words("OP", "after"), LENGTH)))
    with running_app(router, tokenizer=word_tokenizer()) as (address, _):
        status, raw = post(address, "/v1/completions", {**BODY, "stop": "ST OP", "stream": True})
    assert status == 200
    texts = [json.loads(e[6:])["choices"][0]["text"]
             for e in raw.split("\n\n") if e.startswith("data: {")]
    assert "".join(texts) == "hello "  # "ST" was never sent: it began the stop string


def test_without_stop_strings_nothing_is_aborted() -> None:
    router = FakeRouter(script_of((words("hello"), RUN), (words("world"), LENGTH)))
    with running_app(router, tokenizer=word_tokenizer()) as (address, _):
        status, reply = post(address, "/v1/completions", BODY)
    assert (status, reply["choices"][0]["text"]) == (200, "hello world")
    assert router.aborted == []
    assert reply["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4,
                              "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("stream", [False, True])
def test_cached_prompt_tokens_reach_usage_and_metrics(stream: bool) -> None:
    """The decoder's `num_cached_tokens` becomes `usage.prompt_tokens_details.cached_tokens`
    (streamed: in the final usage chunk) and the cached-tokens counter."""
    def script(message: Submit) -> list[RequestEvent]:
        return [RequestEvent(message.request_id, RUN, words("hello"), num_cached_tokens=16),
                RequestEvent(message.request_id, LENGTH, words("world"), num_cached_tokens=16)]

    body = {**BODY, "prompt": list(range(1, 20)), "stream": stream,
            "stream_options": {"include_usage": True}} if stream else {**BODY, "prompt":
                                                                       list(range(1, 20))}
    with running_app(FakeRouter(script), tokenizer=word_tokenizer()) as (address, door):
        status, reply = post(address, "/v1/completions", body)
        metrics = door.metrics.registry.get_sample_value("disagg:prompt_tokens_cached_total",
                                                         {"model_name": door.model_name})
    if stream:
        reply = json.loads([e for e in reply.split("\n\n") if '"usage":{' in e][-1][6:])
    assert status == 200
    assert reply["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}
    assert reply["usage"]["prompt_tokens"] == 19
    assert metrics == 16


def test_past_the_admission_limit_is_429() -> None:
    router = FakeRouter()  # events only when the test sends them
    with running_app(router, max_in_flight=1) as (address, door):
        first = threading.Thread(target=post, args=(address, "/v1/completions", BODY))
        first.start()
        while door.client.num_in_flight < 1:
            time.sleep(0.01)
        status, reply = post(address, "/v1/completions", BODY)
        router.events.put(RequestEvent(router.submitted[0].request_id, LENGTH, [3]))
        first.join(timeout=10)
    assert status == 429
    assert reply["error"]["type"] == "rate_limit_exceeded"
    assert len(router.submitted) == 1  # the refused one never reached a decoder


def test_no_live_decoder_is_503() -> None:
    router = FakeRouter()
    router.alive = [False]
    with running_app(router) as (address, _):
        status, reply = post(address, "/v1/completions", BODY)
    assert status == 503
    assert "no decoder" in reply["error"]["message"]


def failing(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RUN, [3]),
            RequestEvent(message.request_id, RequestState.FINISHED_FAILED,
                         cause=FailureCause.WRITE_FAILED, detail="EIO")]


def test_a_failed_request_is_a_500_naming_the_cause() -> None:
    with running_app(FakeRouter(failing)) as (address, _):
        status, reply = post(address, "/v1/completions", BODY)
    assert status == 500
    assert reply["error"]["code"] == "write_failed"


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event() -> None:
    with running_app(FakeRouter(failing)) as (address, door):
        status, raw = post(address, "/v1/completions", {**BODY, "stream": True})
        metrics = door.metrics
    events = [e for e in raw.split("\n\n") if e]
    assert status == 200  # the headers went out with the first token
    assert json.loads(events[-2][6:])["error"]["code"] == "write_failed"
    assert events[-1] == "data: [DONE]"
    assert metrics.finished.labels("tiny", "error")._value.get() == 1


def test_chat_without_a_template_is_a_400() -> None:
    with running_app(FakeRouter()) as (address, _):
        status, reply = post(address, "/v1/chat/completions",
                             {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400
    assert "no chat template" in reply["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/nothing", "/v2/completions"])
def test_unknown_paths_answer_in_the_openai_error_shape(path: str) -> None:
    with running_app(FakeRouter()) as (address, _):
        status, reply = post(address, path, BODY)
    assert status == 404
    assert set(reply["error"]) == {"message", "type", "param", "code"}


def test_ignore_eos_reaches_the_decoder() -> None:
    """vLLM's extension, which load generators send to get exactly `max_tokens`."""
    router = FakeRouter(script_of((words("hello"), LENGTH)))
    with running_app(router, tokenizer=word_tokenizer()) as (address, _):
        post(address, "/v1/completions", {**BODY, "ignore_eos": True})
        post(address, "/v1/completions", BODY)
    assert [s.ignore_eos for s in router.submitted] == [True, False]


def test_continuous_usage_stats_puts_usage_in_every_chunk() -> None:
    router = FakeRouter(script_of((words("hello"), RUN), (words("world"), LENGTH)))
    options = {"include_usage": True, "continuous_usage_stats": True}
    with running_app(router, tokenizer=word_tokenizer()) as (address, _):
        status, raw = post(address, "/v1/completions",
                           {**BODY, "stream": True, "stream_options": options})
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert status == 200
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]  # the last: usage only
    assert chunks[-1]["choices"] == []


def test_logprobs_stop_where_a_stop_string_cuts_the_text() -> None:
    """The tokens the stop string's text came from (and after) are not the answer: their
    logprobs are not reported, so the logprob tokens spell the text."""
    def script(message: Submit) -> list[RequestEvent]:
        ids = words("hello", "world", "STOP", "after")
        return [RequestEvent(message.request_id, RUN, ids, logprobs=[-0.5] * 4,
                             top_logprob_ids=ids, top_logprobs=[-0.5] * 4),
                RequestEvent(message.request_id, LENGTH, [])]

    with running_app(FakeRouter(script), tokenizer=word_tokenizer()) as (address, _):
        status, reply = post(address, "/v1/completions",
                             {**BODY, "stop": ["STOP"], "logprobs": 1})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["text"] == "hello world "
    assert choice["logprobs"]["tokens"] == ["hello", "world"]
