"""The published OpenAPI document (`disagg.server.openapi`) and a schema-driven fuzz of every
endpoint it lists (schemathesis, bounded examples): nothing answers 5xx (X5b)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.chat_template import ChatTemplate
from tests.disagg.server.app_harness import FakeRouter, running_app

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EXAMPLES_PER_OPERATION = 40


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.RUNNING, [300]),
            RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [301])]


def _document(address: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{address}/openapi.json", timeout=10) as reply:
        return json.loads(reply.read())


def _resolve(document: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


@pytest.mark.parametrize(("path", "model"), [("/v1/completions", "CompletionRequest"),
                                             ("/v1/chat/completions", "ChatCompletionRequest")])
def test_the_endpoints_publish_their_request_models(path: str, model: str) -> None:
    with running_app(FakeRouter(_answers)) as (address, _):
        document = _document(address)
    schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    body = _resolve(document, schema["schema"]["$ref"])
    assert body["title"] == model
    assert "model" in body["required"]
    # Every reference inside the model resolves within the document.
    refs = [value for value in _walk(body) if isinstance(value, str) and value.startswith("#/")]
    assert all(_resolve(document, ref) for ref in refs)


def _walk(node: Any) -> list[Any]:  # noqa: ANN401
    if isinstance(node, dict):
        return [v for value in node.values() for v in [value, *_walk(value)]]
    if isinstance(node, list):
        return [v for value in node for v in [value, *_walk(value)]]
    return []


@pytest.mark.slow
def test_fuzzing_every_endpoint_finds_no_server_error(tiny_tokenizer: Tokenizer) -> None:
    """Valid and invalid bodies, paths and headers from the schema, over real HTTP."""
    schemathesis = pytest.importorskip("schemathesis")
    template = ChatTemplate.for_tokenizer(CHATML, tiny_tokenizer)
    with running_app(FakeRouter(_answers), max_in_flight=64, tokenizer=tiny_tokenizer,
                     chat_template=template) as (address, _):
        schema = schemathesis.openapi.from_dict(_document(address))
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                                  "/v1/models", "/health", "/metrics"}
        modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
        failures: list[str] = []
        for operation in operations:
            strategies = [operation.as_strategy(generation_mode=mode) for mode in modes]

            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=st.one_of(strategies))
            def fuzz(case: Any) -> None:  # noqa: ANN401
                bodies = [case.body]
                if isinstance(case.body, dict):  # and again past the model check, deeper in
                    bodies.append({**case.body, "model": "tiny"})
                for body in bodies:
                    case.body = body
                    response = case.call(base_url=f"http://{address}", timeout=30)
                    if response.status_code >= 500:
                        failures.append(f"{case.method} {case.path} {body!r}: "
                                        f"{response.status_code} {response.text[:300]}")

            fuzz()
    assert failures == []
