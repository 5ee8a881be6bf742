"""The published OpenAPI document (`disagg.server.openapi`) and a schema-driven fuzz of every
endpoint it lists (schemathesis, bounded examples): nothing answers 5xx (X5b)."""

from __future__ import annotations

from typing import Any

import pytest

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.chat_template import ChatTemplate
from tests.disagg.server.app_harness import FakeRouter, running_app
from tests.disagg.server.openapi_fuzz import openapi_document, server_errors

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EXAMPLES_PER_OPERATION = 40


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.RUNNING, [300]),
            RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [301])]


def _resolve(document: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


@pytest.mark.parametrize(("path", "model"), [("/v1/completions", "CompletionRequest"),
                                             ("/v1/chat/completions", "ChatCompletionRequest")])
def test_the_endpoints_publish_their_request_models(path: str, model: str) -> None:
    with running_app(FakeRouter(_answers)) as (address, _):
        document = openapi_document(address)
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
    template = ChatTemplate.for_tokenizer(CHATML, tiny_tokenizer)
    with running_app(FakeRouter(_answers), max_in_flight=64, tokenizer=tiny_tokenizer,
                     chat_template=template) as (address, _):
        assert server_errors(address, "tiny", EXAMPLES_PER_OPERATION) == []
