"""The text paths with SmolLM2 through the real `openai` client: completions and chat equal
`disagg generate` on the same ids; streamed text equals the whole answer."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from disagg.apps.generate import generate_one
from disagg.config import EngineConfig
from disagg.model.loading.registry import load_model
from disagg.server.chat_template import ChatTemplate
from tests.disagg.server.test_openai_e2e import Server, start_server, stop_server

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

MODEL = "smollm2-135m"
CHAT = [{"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    running = start_server("--model", MODEL, "--page-size", "16", "--num-pages", "256",
                           "--chunk-size", "64")
    yield running
    stop_server(running)


def generate(prompt: str | None = None, ids: list[int] | None = None,
             max_tokens: int = 16) -> dict:
    loaded = load_model(MODEL)
    return generate_one(MODEL, EngineConfig(loaded.config), prompt=prompt,
                        prompt_token_ids=ids, max_tokens=max_tokens)


def test_text_completion_equals_generate(server: Server) -> None:
    prompt = "The three primary colors are"
    reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                             temperature=0)
    expected = generate(prompt)
    assert reply.choices[0].text == expected["text"]
    assert reply.choices[0].model_extra["token_ids"] == expected["token_ids"]


def test_chat_completion_equals_generate_on_the_templated_ids(server: Server) -> None:
    loaded = load_model(MODEL)
    assert loaded.chat_template is not None and loaded.tokenizer is not None
    template = ChatTemplate.for_tokenizer(loaded.chat_template, loaded.tokenizer)
    ids = template.render_ids(CHAT, loaded.tokenizer)
    reply = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                                  temperature=0)
    expected = generate(ids=ids, max_tokens=24)
    assert reply.choices[0].message.content == expected["text"]
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == {"length": "length", "stopped": "stop"}[
        expected["finish_reason"]]
    assert reply.usage.prompt_tokens == len(ids)


def test_streamed_chat_deltas_add_up_to_the_answer(server: Server) -> None:
    whole = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                                  temperature=0)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=CHAT,
                                                        max_tokens=24, temperature=0,
                                                        stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_stop_string_ends_the_text_before_it(server: Server) -> None:
    prompt = "The three primary colors are"
    full = generate(prompt, max_tokens=24)["text"]
    word = full.split()[2]  # a word in the middle of the greedy answer
    reply = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                             temperature=0, stop=[word])
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].text == full[:full.index(word)]
