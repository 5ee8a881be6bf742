"""Bounded work before the expensive steps (`disagg.server.limits`, X5b): a body over the
limit is refused before it is read whole, a prompt that cannot fit is refused before it is
tokenized, and tokenizing runs off the event loop."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from collections.abc import Callable

import pytest

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.http_config import HTTPConfig
from disagg.server.limits import max_token_chars
from tests.disagg.server.app_harness import FakeRouter, post, running_app

LIMIT = 4096
BODY = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [3, 4])]


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _read_response(sock: socket.socket) -> tuple[int, bytes]:
    """(status, body) of one response that ends with the connection or a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or b"\r\n\r\n"
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split()[1]), body


def test_a_declared_length_over_the_limit_is_413_before_the_body_is_sent() -> None:
    """64 MiB announced, not a byte of it sent: the answer comes anyway."""
    with running_app(FakeRouter(_answers), http=HTTPConfig(max_body_bytes=LIMIT)) as (
            address, _), _connect(address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ncontent-length: %d\r\n\r\n" % (64 << 20))
        status, body = _read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["code"] == "body_too_large"


def test_a_chunked_body_is_counted_and_refused_at_the_limit() -> None:
    """Twice the limit in chunks and no final chunk: the server cannot have waited for the
    whole body, it stopped reading at the limit."""
    router = FakeRouter(_answers)
    with running_app(router, http=HTTPConfig(max_body_bytes=LIMIT)) as (address, _), \
            _connect(address) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(2):
            sock.sendall(b"%x\r\n%s\r\n" % (LIMIT, b" " * LIMIT))
        status, body = _read_response(sock)
    assert status == 413
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert router.submitted == []


def test_a_body_within_the_limit_is_served() -> None:
    with running_app(FakeRouter(_answers), http=HTTPConfig(max_body_bytes=LIMIT)) as (
            address, _):
        status, _ = post(address, "/v1/completions", BODY)
    assert status == 200


def _spy(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch,
         before: Callable[[], None] = lambda: None) -> list[int]:
    """Record the length of every text `tokenizer.encode` is given (after `before()`)."""
    seen: list[int] = []
    encode = tokenizer.encode

    def spying(text: str, add_special_tokens: bool = True) -> list[int]:
        seen.append(len(text))
        before()
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", spying)
    return seen


def test_a_text_prompt_that_cannot_fit_is_refused_before_tokenizing(
        tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past context x (the longest token's characters + 1) no tokenization can fit it."""
    bound = 4096 * max_token_chars(tiny_tokenizer)
    seen = _spy(tiny_tokenizer, monkeypatch)
    with running_app(FakeRouter(_answers), tokenizer=tiny_tokenizer) as (address, _):
        status, reply = post(address, "/v1/completions", {**BODY, "prompt": "a" * (bound + 1)})
    assert status == 400
    assert reply["error"]["param"] == "prompt"
    assert seen == []


def test_a_text_prompt_within_the_bound_is_tokenized(tiny_tokenizer: Tokenizer,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(tiny_tokenizer, monkeypatch)
    with running_app(FakeRouter(_answers), tokenizer=tiny_tokenizer) as (address, _):
        status, _ = post(address, "/v1/completions", {**BODY, "prompt": "the cat"})
    assert (status, seen) == (200, [7])


def test_the_bound_holds_for_any_text_of_the_vocabulary(tiny_tokenizer: Tokenizer) -> None:
    """No text tokenizes to fewer tokens than its characters / `max_token_chars`."""
    per_token = max_token_chars(tiny_tokenizer)
    for text in ["the cat" * 50, "  " * 300, "\n\n" * 99, "中文" * 40, "<|im_start|>" * 9]:
        assert len(tiny_tokenizer.encode(text, False)) * per_token >= len(text)


def test_other_clients_are_answered_while_a_prompt_tokenizes(
        tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing is held still; /v1/models still answers, so it is not on the event loop."""
    release = threading.Event()
    seen = _spy(tiny_tokenizer, monkeypatch, before=lambda: release.wait(30))
    with running_app(FakeRouter(_answers), tokenizer=tiny_tokenizer) as (address, _):
        busy = threading.Thread(target=post, args=(address, "/v1/completions",
                                                   {**BODY, "prompt": "the cat"}))
        busy.start()
        while not seen:  # the prompt is being tokenized now, and stays so until released
            threading.Event().wait(0.01)
        try:
            with urllib.request.urlopen(f"http://{address}/v1/models", timeout=10) as reply:
                status = reply.status
        finally:
            release.set()
            busy.join(timeout=30)
    assert status == 200
