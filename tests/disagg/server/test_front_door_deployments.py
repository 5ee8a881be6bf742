"""The front door in its other shapes: in front of nodes started by hand (`serve router`), in
front of mixed engines (`serve cluster --mixed`), and `/health` when a node is gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.disagg.server.test_openai_e2e import (
    MODEL,
    Server,
    prompt_of,
    reference_tokens,
    start_server,
    stop_server,
)

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

CACHE = ["--page-size", "4", "--num-pages", "128", "--chunk-size", "8"]


def start_node(*args: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([sys.executable, "-m", "disagg.apps.cli", "serve", *args,
                                "--model", MODEL, *CACHE], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("READY "), process.stderr.read()[-2000:]  # type: ignore[union-attr]
    return process, line.split()[1]


def greedy_ids(server: Server, prompt: list[int], max_tokens: int) -> list[int]:
    reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0)
    return reply.choices[0].model_extra["token_ids"]


def test_router_in_front_of_nodes_started_by_hand() -> None:
    """`serve prefill`, `serve decode --prefiller`, then `serve router --decoder`: the same
    tokens as one node; every process exits 0."""
    prefill, prefill_address = start_node("prefill")
    decode, decode_address = start_node("decode", "--prefiller", prefill_address)
    router = subprocess.Popen([sys.executable, "-m", "disagg.apps.cli", "serve", "router",
                               "--decoder", decode_address, "--model", MODEL, "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert router.stdout is not None
    server = Server(router.stdout.readline().split()[1], router)
    try:
        prompt = prompt_of(17, seed=5)
        assert greedy_ids(server, prompt, 6) == reference_tokens(prompt, 6)
        status, body = server.get("/health")
        assert status == 200
        assert [n["address"] for n in json.loads(body)["nodes"]] == [decode_address]
    finally:
        stop_server(server)
        for node in (decode, prefill):
            node.send_signal(signal.SIGTERM)
            assert node.wait(timeout=60) == 0, node.stderr.read()[-2000:]  # type: ignore[union-attr]


def test_mixed_engines_serve_the_same_tokens() -> None:
    server = start_server("--mixed", "2")
    try:
        for seed in (1, 2, 3):  # least-loaded routing: both engines get work
            prompt = prompt_of(9 + seed, seed=seed)
            assert greedy_ids(server, prompt, 5) == reference_tokens(prompt, 5)
        status, body = server.get("/health")
        assert status == 200
        assert sorted(n["role"] for n in json.loads(body)["nodes"]) == ["mixed", "mixed"]
    finally:
        stop_server(server)


def test_health_is_503_naming_a_node_that_died() -> None:
    """A decoder killed: /health answers 503 and names it; requests go to the survivor."""
    server = start_server("--mixed", "2")
    try:
        nodes = json.loads(server.get("/health")[1])["nodes"]
        victim = nodes[1]
        os.kill(victim["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while (status := server.get("/health")[0]) == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        status, body = server.get("/health")
        assert status == 503
        assert json.loads(body)["missing"] == [victim["name"]]
        prompt = prompt_of(6)
        assert greedy_ids(server, prompt, 3) == reference_tokens(prompt, 3)
    finally:
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=60)  # a node was killed: its exit code is not ours to check
