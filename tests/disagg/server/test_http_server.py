"""The HTTP server's own limits (`disagg.server.http_server`, X5b), over raw sockets: slow
headers are cut off while others are served, idle connections are let go, connections past
the cap are refused with `Retry-After`, huge headers are a 431, and limits are checked when
configured."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.errors import ConfigError
from disagg.server.http_config import HTTPConfig
from tests.disagg.server.app_harness import FakeRouter, post, running_app

BODY = {"model": "tiny", "prompt": [1, 2], "max_tokens": 2}
REQUEST = b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [3, 4])]


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection. A reset counts as the
    close: a byte the slowloris sender writes after the server closed draws an RST, which
    Linux reports only once the data already received has been read."""
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_slow_headers_are_cut_off_while_a_legitimate_request_is_served() -> None:
    """Slowloris: 20 clients send their headers a byte at a time; each is answered 408 and
    closed after the header deadline, and a normal client is served meanwhile."""
    config = HTTPConfig(header_timeout_s=1.0, keep_alive_timeout_s=30)
    with running_app(FakeRouter(_answers), http=config) as (address, _):
        slow = [_connect(address) for _ in range(20)]
        stop = threading.Event()

        def trickle() -> None:
            for i in range(len(REQUEST) - 2):  # never the final blank line
                for sock in slow:
                    try:
                        sock.sendall(REQUEST[i:i + 1])
                    except OSError:
                        pass  # closed by the server: what we want
                if stop.wait(0.1):
                    return

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            status, _ = post(address, "/v1/completions", BODY)
            answers = [_until_closed(sock) for sock in slow]
        finally:
            stop.set()
            sender.join()
            for sock in slow:
                sock.close()
    assert status == 200
    assert all(answer.startswith(b"HTTP/1.1 408 ") for answer in answers), answers[0]


def test_a_connection_that_sends_nothing_is_closed_after_keep_alive() -> None:
    with running_app(FakeRouter(_answers), http=HTTPConfig(keep_alive_timeout_s=0.3)) as (
            address, _), _connect(address) as sock:
        assert _until_closed(sock) == b""


def test_connections_past_the_cap_get_503_with_retry_after() -> None:
    config = HTTPConfig(max_connections=4, header_timeout_s=30, keep_alive_timeout_s=30)
    with running_app(FakeRouter(_answers), http=config) as (address, _):
        held = [_connect(address) for _ in range(4)]
        time.sleep(0.1)  # the server has accepted them (connection_made)
        with _connect(address) as extra:
            refused = _until_closed(extra)
        held.pop().close()
        time.sleep(0.1)
        status, _ = post(address, "/v1/completions", BODY)
        for sock in held:
            sock.close()
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ")
    assert b"retry-after: 1" in head.lower()
    assert json.loads(body)["error"]["type"] == "service_unavailable"
    assert status == 200  # a freed place is served again


def test_huge_headers_are_431() -> None:
    config = HTTPConfig(max_header_bytes=4096)
    with running_app(FakeRouter(_answers), http=config) as (address, _), \
            _connect(address) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 8192 + b"\r\n\r\n")
        answer = _until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431 ")


def test_a_malformed_request_is_still_400() -> None:
    with running_app(FakeRouter(_answers)) as (address, _), _connect(address) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert _until_closed(sock).startswith(b"HTTP/1.1 400 ")


def test_429_carries_retry_after() -> None:
    router = FakeRouter()  # events only when the test sends them
    with running_app(router, max_in_flight=1) as (address, door):
        first = threading.Thread(target=post, args=(address, "/v1/completions", BODY))
        first.start()
        while door.client.num_in_flight < 1:
            time.sleep(0.01)
        host, port = address.rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request("POST", "/v1/completions", json.dumps(BODY),
                           {"Content-Type": "application/json"})
        reply = connection.getresponse()
        reply.read()
        router.events.put(RequestEvent(router.submitted[0].request_id,
                                       RequestState.FINISHED_LENGTH, [3]))
        first.join(timeout=10)
    assert reply.status == 429
    assert reply.getheader("retry-after") == "1"


@pytest.mark.parametrize("field", ["max_in_flight", "max_body_bytes", "max_connections",
                                   "max_header_bytes", "header_timeout_s",
                                   "keep_alive_timeout_s"])
def test_a_limit_below_one_is_a_config_error(field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        HTTPConfig(**{field: 0})
