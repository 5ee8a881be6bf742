"""One request, one trace (X7a): `serve cluster` with `--otlp-endpoint`, real processes over
the real fabric and real HTTP, spans received over OTLP/HTTP and decoded with the protocol's
own messages. The client's `traceparent` is continued; every process's spans hang where
they should: front door -> decoder -> prefiller."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.disagg.server.otlp_receiver import OTLPReceiver, ReceivedSpan

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
HTTP_SPAN = "POST /v1/completions"
PROMPT = list(range(3, 16))  # 13 tokens: two prefill chunks of 8


@pytest.fixture(scope="module")
def spans() -> Iterator[list[ReceivedSpan]]:
    """The spans a cluster of one prefiller and one decoder exports for one completion."""
    receiver = OTLPReceiver()
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "100"}  # the SDK's batch delay, in ms
    process = subprocess.Popen(
        [sys.executable, "-m", "disagg.apps.cli", "serve", "cluster", "--model", "tiny",
         "--port", "0", "--page-size", "4", "--num-pages", "64", "--chunk-size", "8",
         "--prefillers", "1", "--decoders", "1", "--otlp-endpoint", receiver.endpoint,
         "--no-access-log"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("READY "), process.stderr.read()[-3000:]  # type: ignore[union-attr]
        host, port = line.split()[1].removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        connection.request("POST", "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
            {"Content-Type": "application/json",
             "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert connection.getresponse().status == 200
        connection.close()
        deadline = time.monotonic() + 30
        wanted = {HTTP_SPAN, "request", "kv_request", "transfer_tail", "decode"}
        while not wanted <= {s.name for s in receiver.received()}:
            assert time.monotonic() < deadline, sorted({s.name for s in receiver.received()})
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        yield receiver.received()
    finally:
        if process.poll() is None:
            process.kill()
        receiver.close()


def _one(spans: list[ReceivedSpan], name: str, process: str) -> ReceivedSpan:
    [span] = [s for s in spans if s.name == name and s.process == process]
    return span


def test_every_span_is_in_the_clients_trace(spans: list[ReceivedSpan]) -> None:
    """Nothing else was exported: health checks are not traced, engine steps stay local."""
    assert {s.trace_id for s in spans} == {TRACE_ID}


def test_spans_come_from_three_processes(spans: list[ReceivedSpan]) -> None:
    assert {"front-door", "decode-0", "prefill-0"} <= {s.process for s in spans}
    assert len({s.pid for s in spans}) >= 3


def test_each_process_hangs_under_the_one_that_called_it(spans: list[ReceivedSpan]) -> None:
    """Client -> HTTP span -> the decoder's request -> the prefiller's kv_request."""
    http_span = _one(spans, HTTP_SPAN, "front-door")
    request = _one(spans, "request", "decode-0")
    kv_request = _one(spans, "kv_request", "prefill-0")
    assert http_span.parent_id == CLIENT_SPAN
    assert request.parent_id == http_span.span_id
    assert kv_request.parent_id == request.span_id


def test_each_step_of_the_request_is_a_child_of_its_process_span(
        spans: list[ReceivedSpan]) -> None:
    http_span = _one(spans, HTTP_SPAN, "front-door")
    request = _one(spans, "request", "decode-0")
    kv_request = _one(spans, "kv_request", "prefill-0")
    children = {(s.process, s.name, s.parent_id) for s in spans}
    for name in ("route", "first_token"):
        assert ("front-door", name, http_span.span_id) in children
    for name in ("admission", "kv_wait", "first_token_sent", "decode"):
        assert ("decode-0", name, request.span_id) in children
    for name in ("queue", "prefill", "transfer_tail"):
        assert ("prefill-0", name, kv_request.span_id) in children
    chunks = [s for s in spans if s.name == "prefill_chunk"]
    assert len(chunks) == 2 and {s.parent_id for s in chunks} == {kv_request.span_id}
    layers = [s for s in spans if s.name == "layer_writes"]
    assert layers and {s.parent_id for s in layers} == {kv_request.span_id}


def test_no_span_names_a_parent_that_is_not_there(spans: list[ReceivedSpan]) -> None:
    ids = {s.span_id for s in spans} | {CLIENT_SPAN}
    assert [s.name for s in spans if s.parent_id not in ids] == []
