"""`POST /tokenize`, `POST /detokenize` and `GET /version` (`disagg.server.utility_routes`):
tokenize answers the ids the completions routes send, detokenize gives their text back, and
bad input is a 400 naming its field, as on the completions routes. Over real HTTP, in front of
a scripted router; SmolLM2's own tokenizer and template where the text is the point."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from disagg.control.messages import RequestEvent, Submit
from disagg.engine.request import RequestState
from disagg.model.loading.registry import LoadedModel
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.app import FrontDoor
from disagg.server.chat_template import ChatTemplate
from disagg.server.http_config import HTTPConfig
from tests.disagg.server.app_harness import FakeRouter, post, running_app
from tests.disagg.server.openapi_fuzz import openapi_document

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Capital of France? 中文 <|im_end|>"}]
TEXT = "The cat sat on the mat, 1234 times. 中文 <|im_start|>"


def _answers(message: Submit) -> list[RequestEvent]:
    return [RequestEvent(message.request_id, RequestState.FINISHED_LENGTH, [5])]


@contextmanager
def _tiny(tokenizer: Tokenizer | None, chat: bool = True,
          http: HTTPConfig | None = None) -> Iterator[tuple[str, FrontDoor, FakeRouter]]:
    """The tiny model's front door with `tokenizer` (and ChatML when `chat`)."""
    template = ChatTemplate.for_tokenizer(CHATML, tokenizer) if chat and tokenizer else None
    router = FakeRouter(_answers)
    with running_app(router, tokenizer=tokenizer, chat_template=template, http=http) as (
            address, door):
        yield address, door, router


@pytest.fixture
def smollm2(smollm2_model: LoadedModel) -> Iterator[tuple[str, FrontDoor, FakeRouter]]:
    """A front door with SmolLM2's config, tokenizer and chat template."""
    assert smollm2_model.tokenizer is not None
    assert smollm2_model.chat_template is not None
    with _tiny(smollm2_model.tokenizer, chat=False) as (address, door, router):
        door.model = smollm2_model.config  # read per request: the vocabulary and the context
        door.chat_template = ChatTemplate.for_tokenizer(smollm2_model.chat_template,
                                                        smollm2_model.tokenizer)
        yield address, door, router


def _error(reply: Any) -> tuple[str | None, str | None]:  # noqa: ANN401
    return reply["error"]["param"], reply["error"]["code"]


@pytest.mark.slow
def test_tokenize_then_detokenize_gives_smollm2_text_back(
        smollm2: tuple[str, FrontDoor, FakeRouter]) -> None:
    address, door, _ = smollm2
    status, tokens = post(address, "/tokenize", {"model": "tiny", "prompt": TEXT})
    assert status == 200
    assert tokens["tokens"] == door.prompt_ids(TEXT)
    assert (tokens["count"], tokens["max_model_len"]) == (len(tokens["tokens"]), 8192)
    assert post(address, "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": TEXT})


@pytest.mark.slow
def test_chat_tokenize_is_what_chat_completions_sends(
        smollm2: tuple[str, FrontDoor, FakeRouter]) -> None:
    """The same ids reach the cluster as /tokenize answers, through `FrontDoor.chat_ids`."""
    address, _, router = smollm2
    status, tokens = post(address, "/tokenize", {"messages": MESSAGES})
    assert status == 200
    assert post(address, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES,
                                                  "max_tokens": 1})[0] == 200
    assert tokens["tokens"] == router.submitted[0].prompt_token_ids


def test_add_generation_prompt_reaches_the_template(tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer) as (address, _, _):
        _, with_prompt = post(address, "/tokenize", {"messages": MESSAGES})
        _, without = post(address, "/tokenize", {"messages": MESSAGES,
                                                 "add_generation_prompt": False})
    assert with_prompt["tokens"][:without["count"]] == without["tokens"]
    assert with_prompt["count"] > without["count"]


def test_detokenize_keeps_special_tokens(tiny_tokenizer: Tokenizer) -> None:
    """As vLLM's: the text of every id, the template's markers too."""
    with _tiny(tiny_tokenizer) as (address, _, _):
        _, tokens = post(address, "/tokenize", {"messages": MESSAGES[:1]})
        status, text = post(address, "/detokenize", {"tokens": tokens["tokens"]})
    assert status == 200
    assert text["prompt"] == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_a_model_without_a_tokenizer_is_a_400_naming_the_field(
        path: str, body: dict, param: str) -> None:
    with _tiny(None) as (address, _, _):
        status, reply = post(address, path, body)
    assert (status, _error(reply)[0]) == (400, param)
    assert "no tokenizer" in reply["error"]["message"]


def test_messages_without_a_chat_template_are_a_400_naming_messages(
        tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer, chat=False) as (address, _, _):
        status, reply = post(address, "/tokenize", {"messages": MESSAGES})
    assert (status, _error(reply)[0]) == (400, "messages")


@pytest.mark.parametrize("bad", [-1, 268, 10**30])  # the tiny vocabulary has 268 entries
def test_ids_outside_the_vocabulary_are_a_400_naming_tokens(
        bad: int, tiny_tokenizer: Tokenizer) -> None:
    """268 is inside the model's 512 ids but has no text: refused, not skipped silently."""
    with _tiny(tiny_tokenizer) as (address, _, _):
        status, reply = post(address, "/detokenize", {"tokens": [5, bad]})
    assert (status, _error(reply)[0]) == (400, "tokens")
    assert str(bad) in reply["error"]["message"]


def test_more_ids_than_the_context_are_a_400_naming_tokens(tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer) as (address, door, _):
        context = door.model.max_position_embeddings
        status, reply = post(address, "/detokenize", {"tokens": [5] * (context + 1)})
    assert (status, _error(reply)[0]) == (400, "tokens")


@pytest.mark.parametrize(("body", "param"), [
    ({"tokens": ["a"]}, "tokens.0"),
    ({"tokens": [True]}, "tokens.0"),
    ({}, "tokens"),
])
def test_detokenize_validates_like_the_completions_routes(body: dict, param: str,
                                                          tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer) as (address, _, _):
        status, reply = post(address, "/detokenize", body)
    assert (status, _error(reply)[0]) == (400, param)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "messages": MESSAGES}, "messages"),
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"messages": []}, "messages"),
    ({"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
    ({"messages": MESSAGES, "add_special_tokens": True}, "add_special_tokens"),
    ({"prompt": "hi", "return_token_strs": True}, "return_token_strs"),
])
def test_tokenize_refuses_what_it_cannot_answer_naming_the_field(
        body: dict, param: str, tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer) as (address, _, _):
        status, reply = post(address, "/tokenize", body)
    assert (status, _error(reply)[0]) == (400, param)


@pytest.mark.parametrize(("body", "default"), [({"prompt": "hi"}, True),
                                               ({"messages": MESSAGES}, False)])
def test_add_special_tokens_at_what_the_route_does_is_accepted(
        body: dict, default: bool, tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer) as (address, _, _):
        assert post(address, "/tokenize", {**body, "add_special_tokens": default})[0] == 200


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_another_model_is_model_not_found(path: str, tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer) as (address, _, _):
        status, reply = post(address, path, {"model": "gpt-4", "prompt": "hi", "tokens": [5]})
    assert (status, _error(reply)) == (400, ("model", "model_not_found"))


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_over_the_limit_is_413(path: str, tiny_tokenizer: Tokenizer) -> None:
    with _tiny(tiny_tokenizer, http=HTTPConfig(max_body_bytes=64)) as (address, _, _):
        status, reply = post(address, path, {"prompt": "x" * 100, "tokens": [5] * 100})
    assert (status, _error(reply)[1]) == (413, "body_too_large")


def test_version_is_the_installed_package_version() -> None:
    import urllib.request

    with _tiny(None) as (address, _, _), \
            urllib.request.urlopen(f"http://{address}/version", timeout=10) as reply:
        assert reply.read() == (b'{"version":"%s"}'
                                % importlib.metadata.version("disagg").encode())


@pytest.mark.parametrize(("path", "model"), [("/tokenize", "TokenizeRequest"),
                                             ("/detokenize", "DetokenizeRequest")])
def test_the_openapi_document_publishes_the_request_bodies(path: str, model: str) -> None:
    with _tiny(None) as (address, _, _):
        document = openapi_document(address)
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == f"#/components/schemas/{model}"
    assert document["components"]["schemas"][model]["title"] == model
    assert "/version" in document["paths"]
