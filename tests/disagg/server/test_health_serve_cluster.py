"""`disagg serve cluster` over real HTTP (X5e): the prefiller killed, `/health` is 503 naming
it; the supervisor starts it again, `/health` is 200 with its restart count and new pid, and
the next completion is the single-node engine's tokens."""

from __future__ import annotations

import json
import os
import signal
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


def health_until(server: Server, status: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while (reply := server.get("/health"))[0] != status:
        assert time.monotonic() < deadline, reply
        time.sleep(0.1)
    return json.loads(reply[1])


def test_a_killed_prefiller_is_named_then_restarted() -> None:
    server = start_server()
    try:
        body = health_until(server, 200, 30)
        victim = {n["name"]: n for n in body["nodes"]}["prefill-0"]
        assert victim["restarts"] == 0 and body["prefillers"][0]["pid"] == victim["pid"]
        os.kill(victim["pid"], signal.SIGKILL)
        body = health_until(server, 503, 10)
        assert "prefill-0" in body["missing"], body
        body = health_until(server, 200, 90)
        back = body["prefillers"][0]
        assert (back["name"], back["restarts"], back["address"]) == (
            "prefill-0", 1, victim["address"])
        assert back["pid"] != victim["pid"]
        prompt = prompt_of(11, seed=4)
        reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                                 temperature=0)
        assert reply.choices[0].model_extra["token_ids"] == reference_tokens(prompt, 5)
    finally:
        stop_server(server)  # every node, the restarted one included, exits 0
