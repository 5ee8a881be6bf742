"""The API key (`disagg.server.api_key`): with `HTTPConfig.api_key` set, `/v1/*`, `/tokenize`
and `/detokenize` answer 401 in OpenAI's shape without `Authorization: Bearer KEY`; the probes
stay open; a stream passes through the check unbuffered. Over real HTTP, with the `openai`
client where a client sees it."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from disagg.apps.cli import main
from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.errors import ConfigError
from disagg.server import api_key
from disagg.server.http_config import HTTPConfig
from tests.disagg.server.app_harness import FakeRouter, running_app

KEY = "sk-test-0123456789"
KEYED = HTTPConfig(api_key=KEY)
BODY = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.RUNNING, [5]),
            RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [6])]


def _client(address: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0,
                         timeout=10)


def _request(address: str, method: str, path: str, headers: dict[str, str] | None = None,
             body: dict | None = None) -> tuple[int, dict[str, str], str]:
    host, port = address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.request(method, path, None if body is None else json.dumps(body).encode(),
                       {"Content-Type": "application/json", **(headers or {})})
    reply = connection.getresponse()
    return reply.status, dict(reply.getheaders()), reply.read().decode()


def test_a_wrong_key_is_openais_authentication_error() -> None:
    """The openai client raises its own AuthenticationError, with OpenAI's error body."""
    router = FakeRouter(_answers)
    with running_app(router, http=KEYED) as (address, _), \
            pytest.raises(openai.AuthenticationError) as caught:
        _client(address, "wrong").completions.create(**BODY)
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "invalid_request_error"
    assert caught.value.body["code"] == "invalid_api_key"
    assert router.submitted == []  # refused before anything reached the cluster


def test_the_right_key_gets_a_completion() -> None:
    with running_app(FakeRouter(_answers), http=KEYED) as (address, _):
        reply = _client(address, KEY).completions.create(**BODY)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 2


def test_a_missing_key_is_401_in_openais_shape_naming_bearer() -> None:
    with running_app(FakeRouter(_answers), http=KEYED) as (address, _):
        status, headers, text = _request(address, "POST", "/v1/completions", body=BODY)
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    error = json.loads(text)["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", None, "invalid_api_key")
    assert "Authorization: Bearer" in error["message"]


@pytest.mark.parametrize(("method", "path"), [("GET", "/v1/models"), ("POST", "/tokenize"),
                                              ("POST", "/detokenize"), ("GET", "/v1/unknown")])
def test_every_keyed_path_refuses_a_wrong_key(method: str, path: str) -> None:
    """The utility routes too, and unknown /v1 paths (a 404 would list the routes)."""
    with running_app(FakeRouter(_answers), http=KEYED) as (address, _):
        status, _, text = _request(address, method, path, {"Authorization": "Bearer nope"},
                                   {"tokens": [1]})
    assert status == 401
    assert KEY not in text
    assert "nope" not in text


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version", "/openapi.json"])
def test_probes_and_the_schema_stay_open(path: str) -> None:
    with running_app(FakeRouter(_answers), http=KEYED) as (address, _):
        assert _request(address, "GET", path)[0] == 200


def test_a_stream_with_a_wrong_key_is_refused() -> None:
    router = FakeRouter(_answers)
    with running_app(router, http=KEYED) as (address, _), \
            pytest.raises(openai.AuthenticationError):
        _client(address, "wrong").completions.create(**BODY, stream=True)
    assert router.submitted == []


def test_a_stream_passes_the_check_one_chunk_at_a_time() -> None:
    """Each chunk reaches the client while the request still runs: the check buffers
    nothing (the router sends the next token only after the client has read the first)."""
    router = FakeRouter()  # the test sends the events
    with running_app(router, http=KEYED) as (address, _):
        stream = _client(address, KEY).completions.create(**BODY, stream=True)
        deadline = time.monotonic() + 5
        while not router.submitted and time.monotonic() < deadline:
            time.sleep(0.01)
        request_id = router.submitted[0].request_id
        router.events.put(RequestEvent(request_id, RequestState.RUNNING, [5]))
        first = next(iter(stream))
        assert first.choices[0].token_ids == [5]  # the extension lists the ids behind the text
        router.events.put(RequestEvent(request_id, RequestState.FINISHED_LENGTH, [6]))
        rest = list(stream)
    assert [c.choices[0].finish_reason for c in rest] == ["length"]


@pytest.mark.parametrize("header", [b"bearer " + KEY.encode(), b"Bearer  " + KEY.encode()])
def test_the_scheme_is_case_insensitive_and_spaces_are_forgiven(header: bytes) -> None:
    assert api_key.check_authorization(header, KEY.encode()) is None


@pytest.mark.parametrize("header", [None, KEY.encode(), b"Basic " + KEY.encode(),
                                    b"Bearer " + KEY.encode()[:-1], b"Bearer"])
def test_anything_but_bearer_and_the_key_is_refused(header: bytes | None) -> None:
    error = api_key.check_authorization(header, KEY.encode())
    assert error is not None
    assert error.status == 401


def test_the_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """`hmac.compare_digest` decides, not `==` (whose time says how many bytes matched)."""
    seen: list[tuple[bytes, bytes]] = []
    monkeypatch.setattr(api_key.hmac, "compare_digest",
                        lambda a, b: seen.append((a, b)) or False)
    assert api_key.check_authorization(b"Bearer " + KEY.encode(), KEY.encode()) is not None
    assert seen == [(KEY.encode(), KEY.encode())]


@pytest.mark.parametrize("key", ["has space 42", "caf\u00e9-42", "line\nbreak-42"])
def test_a_key_no_client_can_send_is_a_config_error_that_hides_it(key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        HTTPConfig(api_key=key)
    assert "42" not in str(caught.value)


def test_an_empty_key_is_a_config_error() -> None:
    """Not "no key": a server told to ask for a key must not answer everyone."""
    with pytest.raises(ConfigError, match="api_key"):
        HTTPConfig(api_key="")


def test_the_config_does_not_print_the_key() -> None:
    assert KEY not in repr(KEYED)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_serve_router_takes_the_key_from_the_flag_or_disagg_api_key(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import disagg.server.launch as launch

    configs: list[HTTPConfig] = []
    monkeypatch.setattr(launch, "serve_router",
                        lambda model, decoders, http, *rest, **_: configs.append(http))
    monkeypatch.delenv("DISAGG_API_KEY", raising=False)
    argv = ["serve", "router", "--model", "tiny", "--decoder", "127.0.0.1:7001"]
    if how == "flag":
        argv += ["--api-key", KEY]
    else:
        monkeypatch.setenv("DISAGG_API_KEY", KEY)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert (exit_info.value.code or 0) == 0
    assert [c.api_key for c in configs] == [KEY]
