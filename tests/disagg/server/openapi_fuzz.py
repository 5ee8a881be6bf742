"""A schema-driven fuzz of every endpoint a front door's `/openapi.json` lists (schemathesis,
bounded examples, valid and invalid cases): the server errors (5xx) it met (X5b)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
# The deepest variant of a drawn body: what the schema cannot say (an existing model, token ids
# within the vocabulary, a short answer), so its sampling and stop fields reach the nodes.
VALID_INPUT = {"/v1/completions": ("prompt", [5, 6, 7, 8]),
               "/v1/chat/completions": ("messages", [{"role": "user", "content": "Hi"}])}
MAX_TOKENS = 8


def _capped(body: dict[str, Any]) -> dict[str, Any]:
    capped = dict(body)
    for field in ("max_tokens", "max_completion_tokens"):
        drawn = capped.get(field)
        capped[field] = min(drawn, MAX_TOKENS) if isinstance(drawn, int) else MAX_TOKENS
    return capped


def variants(path: str, body: Any, model: str, cap_all: bool) -> list[Any]:  # noqa: ANN401
    """`body` as drawn, then (for a dict) with the served `model`, then also with a valid
    input. The last answers at most `MAX_TOKENS` tokens, the second too with `cap_all` (real
    nodes decode a drawn max_tokens for minutes)."""
    if not isinstance(body, dict):
        return [body]
    named = {**body, "model": model}
    deepest = _capped(named)
    if path in VALID_INPUT:
        field, value = VALID_INPUT[path]
        deepest[field] = value
    return [body, _capped(named) if cap_all else named, deepest]


def openapi_document(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/openapi.json", timeout=10) as reply:
        return json.loads(reply.read())


def server_errors(address: str, model: str, examples_per_operation: int,
                  cap_all: bool = False) -> list[str]:
    """Each 5xx as "METHOD PATH body: status text", every case sent in each of its
    `variants`."""
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_dict(openapi_document(address))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= ENDPOINTS
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    failures: list[str] = []
    for operation in operations:
        strategies = [operation.as_strategy(generation_mode=mode) for mode in modes]

        @settings(max_examples=examples_per_operation, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=st.one_of(strategies))
        def fuzz(case: Any) -> None:  # noqa: ANN401
            for body in variants(case.path, case.body, model, cap_all):
                case.body = body
                response = case.call(base_url=f"http://{address}", timeout=60)
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.path} {body!r}: "
                                    f"{response.status_code} {response.text[:300]}")

        fuzz()
    return failures
