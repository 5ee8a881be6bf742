"""`disagg serve cluster` as a user runs it: real processes over libfabric, real HTTP, the real
`openai` client. Tiny model, token-id prompts (it has no tokenizer); the text paths with
SmolLM2 are in test_openai_text.py."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
import torch

from disagg import CacheConfig, EngineConfig, SamplingParams, build_engine, load_model
from disagg.server.scrape_targets import scrape_cluster

# Slow: a whole cluster and its front door start once for the module (about 10 s in all).
pytestmark = [pytest.mark.fabric, pytest.mark.slow]

MODEL = "tiny"


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]

    @property
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def post(self, path: str, body: bytes) -> tuple[int, dict]:
        status, text = self.post_raw(path, body)
        return status, json.loads(text)

    def post_raw(self, path: str, body: bytes) -> tuple[int, str]:
        """The status and body text (a stream's too) of a JSON POST."""
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            return reply.status, reply.read().decode()
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        """The front door's series and every node's (found through `/metrics/targets`, each
        with its target's labels), as Prometheus would store them."""
        return {sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
                for sample in scrape_cluster(self.url, timeout_s=30)}


def start_server(*args: str) -> Server:
    process = subprocess.Popen(
        [sys.executable, "-m", "disagg.apps.cli", "serve", "cluster", "--model", MODEL,
         "--port", "0", "--page-size", "4", "--num-pages", "128", "--chunk-size", "8",
         "--no-access-log", *args],  # stderr is read only on failure: keep it small
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("READY "):
        process.kill()
        raise AssertionError(f"no READY line: {line!r} {process.stderr.read()[-3000:]}")
    return Server(line.split()[1], process)


def stop_server(server: Server) -> None:
    server.process.send_signal(signal.SIGINT)
    try:
        code = server.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        raise
    assert code == 0, server.process.stderr.read()[-3000:]  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """One prefiller and one decoder behind the HTTP API; it must stop clean (exit 0)."""
    running = start_server("--prefillers", "1", "--decoders", "1")
    yield running
    stop_server(running)


def reference_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    loaded = load_model(MODEL)
    engine = build_engine(EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=64)),
                          loaded.state_dict)
    [request] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))
    return request.output_token_ids


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_completion_equals_one_node(server: Server) -> None:
    """Prompt ids in, the single-node engine's greedy tokens out (`token_ids` extension)."""
    prompt = prompt_of(13)
    reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                             temperature=0)
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == reference_tokens(prompt, 10)
    assert choice.finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (13, 10)
    assert reply.object == "text_completion"
    assert reply.model == MODEL


def test_streamed_completion_equals_unstreamed(server: Server) -> None:
    prompt = prompt_of(21, seed=1)
    chunks = list(server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == reference_tokens(prompt, 8)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_framing_is_data_lines_then_done(server: Server) -> None:
    """At the byte level: `data: <json>` events separated by blank lines, then [DONE]."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True}
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200
    assert reply.getheader("content-type").startswith("text/event-stream")
    raw = reply.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == ""  # the stream ends with a blank line
    assert events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event.removeprefix("data: "))["object"] == "text_completion"


@pytest.mark.parametrize(("body", "param", "words"), [
    (b"{not json", None, "not valid JSON"),
    (b'{"model": "tiny", "prompt": [1], "max_tokens": 0}', "max_tokens", "greater than"),
    (b'{"model": "tiny", "prompt": [1], "temperature": NaN}', None, "NaN"),
    (b'{"model": "tiny", "prompt": [1], "temperature": "hot"}', "temperature", "number"),
    (b'{"model": "tiny", "prompt": [1], "max_tokens": 5000}', "max_tokens", "context"),
    (b'{"model": "tiny", "prompt": [99999]}', "prompt", "vocabulary"),
    (b'{"model": "tiny", "prompt": "text"}', "prompt", "no tokenizer"),
    (b'{"model": "tiny", "prompt": [1], "n": 17}', "n", "16"),
    (b'{"model": "gpt-9", "prompt": [1]}', "model", "does not exist"),
    (b'{"model": "tiny"}', "prompt", "required"),
])
def test_bad_input_is_a_400_naming_the_field(server: Server, body: bytes, param: str | None,
                                             words: str) -> None:
    status, reply = server.post("/v1/completions", body)
    assert status == 400
    error = reply["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


def test_a_request_larger_than_the_cache_is_a_400_and_the_node_survives(server: Server) -> None:
    """128 pages of 4 tokens: 600 tokens can never fit; refused before reaching a node."""
    status, reply = server.post("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": prompt_of(600), "max_tokens": 2}).encode())
    assert status == 400, reply
    assert reply["error"]["param"] == "max_tokens"
    assert "cache" in reply["error"]["message"]
    assert len(server.client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2,
                                                temperature=0).choices[0].model_extra[
        "token_ids"]) == 2


def test_models_and_health(server: Server) -> None:
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    status, text = server.get("/health")
    assert status == 200
    nodes = json.loads(text)["nodes"]
    assert sorted(n["role"] for n in nodes) == ["decode", "prefill"]
    assert all(n["state"] == "ok" and n["pid"] > 0 for n in nodes)


def test_client_gone_mid_stream_aborts_and_frees_every_page(server: Server) -> None:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    body = {"model": MODEL, "prompt": prompt_of(30, seed=3), "max_tokens": 400,
            "stream": True, "temperature": 0}  # 430 tokens: 108 of the 128 pages
    connection.request("POST", "/v1/completions", json.dumps(body),
                       {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.readline().startswith(b"data: ")
    connection.sock.shutdown(socket.SHUT_RDWR)  # the client vanishes mid-stream
    reply.close()
    connection.close()
    aborted = 'disagg:request_success_total{"finished_reason": "abort", "model_name": "tiny"}'
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = server.metrics()
        pages = [v for k, v in metrics.items() if k.startswith("disagg:kv_pages_in_use")]
        if metrics.get(aborted, 0) >= 1 and pages and not any(pages):
            break
        time.sleep(0.2)
    assert metrics.get(aborted, 0) >= 1, metrics
    assert len(pages) == 2 and not any(pages), pages  # both nodes: every page back
    assert metrics['disagg:num_requests_running{"model_name": "tiny"}'] == 0


def test_metrics_parse_and_count_requests(server: Server) -> None:
    server.client.completions.create(model=MODEL, prompt=[4, 5, 6], max_tokens=4, temperature=0)
    metrics = server.metrics()
    label = '{"model_name": "tiny"}'
    assert metrics["disagg:time_to_first_token_seconds_count" + label] >= 1
    assert metrics["disagg:e2e_request_latency_seconds_count" + label] >= 1
    assert metrics["disagg:generation_tokens_total" + label] >= 4
    assert metrics["disagg:prompt_tokens_total" + label] >= 3
    assert any(k.startswith("disagg:kv_bytes_total") and v > 0 for k, v in metrics.items())
