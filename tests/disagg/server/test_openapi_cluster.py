"""Drawn requests against `disagg serve cluster` itself, SmolLM2 (its tokenizer and chat
template) on real nodes behind it (X5a, X5b, X5e): the schema-driven fuzz, and sampling
values drawn over the whole accepted range. No 5xx, and no node disturbed: the same pids, no
restart, every page back, the single-node tokens afterwards, every node exits clean."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.disagg.server.openapi_fuzz import server_errors
from tests.disagg.server.test_openai_e2e import Server, start_server, stop_server
from tests.disagg.server.test_health_serve_cluster import health_until
from tests.disagg.server.test_openai_text import MODEL, generate

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

EXAMPLES_PER_OPERATION = 15
SAMPLING_EXAMPLES = 30
TINY = 5e-324  # the smallest positive float


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = start_server("--model", MODEL, "--page-size", "16", "--num-pages", "256",
                           "--chunk-size", "64")
    yield running
    stop_server(running)  # exit 0: every node's leak check passed


def _nodes(server: Server) -> dict[str, tuple[int, int]]:
    """Node name -> (pid, restarts), once `/health` is 200."""
    return {n["name"]: (n["pid"], n["restarts"]) for n in health_until(server, 200, 30)["nodes"]}


def _pages_in_use(server: Server) -> list[float]:
    return [v for k, v in server.metrics().items() if k.startswith("disagg:kv_pages_in_use")]


def assert_undisturbed(server: Server, before: dict[str, tuple[int, int]]) -> None:
    """The nodes of `before`, none restarted, every page back, the single-node tokens."""
    assert _nodes(server) == before and all(r == 0 for _, r in before.values())
    deadline = time.monotonic() + 10
    while any(_pages_in_use(server)):
        assert time.monotonic() < deadline, _pages_in_use(server)
        time.sleep(0.1)
    prompt = "The three primary colors are"
    reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                             temperature=0)
    assert reply.choices[0].model_extra["token_ids"] == generate(prompt, max_tokens=8)[
        "token_ids"]


def test_fuzzing_every_endpoint_disturbs_no_node(server: Server) -> None:
    before = _nodes(server)
    address = server.url.removeprefix("http://")
    assert server_errors(address, MODEL, EXAMPLES_PER_OPERATION, cap_all=True) == []
    assert_undisturbed(server, before)


EDGES = st.sampled_from([TINY, 1e-300, 1e-45, 1e-5, 1.0 - 1e-16, 1.0])
SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(EDGES, st.floats(0.0, 2.0), st.sampled_from([0.0, 2.0])),
    "top_p": st.one_of(EDGES, st.floats(TINY, 1.0)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2, 49151, 49152, 2**62]),
                       st.integers(-2**63, 2**63)),
    "seed": st.one_of(st.sampled_from([0, 2**63 - 1]), st.integers(0, 2**63 - 1)),
    "stream": st.booleans(),
})


def test_sampling_values_over_their_whole_range_disturb_no_node(server: Server) -> None:
    """Every accepted value samples (200 and at most max_tokens), the others are 400s."""
    before = _nodes(server)
    outcomes: list[int] = []

    @settings(max_examples=SAMPLING_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fields=SAMPLING)
    def draw(fields: dict) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, **fields}
        status, reply = server.post_raw("/v1/completions", json.dumps(body).encode())
        assert status in (200, 400), (body, status, reply[:300])
        outcomes.append(status)
        if status == 200 and not fields.get("stream"):
            assert json.loads(reply)["usage"]["completion_tokens"] <= 4, body

    draw()
    assert outcomes.count(200) >= SAMPLING_EXAMPLES // 2, outcomes  # the values reached nodes
    assert_undisturbed(server, before)
