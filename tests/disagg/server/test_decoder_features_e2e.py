"""What only a decoder does, through a real cluster and the real `openai` client (S8):
structured output that validates and equals a single node, logprobs equal transformers', a
tool-call round trip, and response objects exactly of the OpenAI API's types."""

from __future__ import annotations

import json
import time
from typing import Any

import jsonschema
import openai
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from disagg.config import CacheConfig, EngineConfig
from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.guided import GuideCompiler
from disagg.engine.llm_engine import EngineParts, LLMEngine, load_transformer
from disagg.engine.request import SamplingParams
from disagg.model.loading.registry import LoadedModel
from disagg.server.chat_template import ChatTemplate
from tests.disagg.server.test_openai_e2e import Server
from tests.disagg.server.test_openai_text import server  # noqa: F401 (the SmolLM2 cluster)

pytestmark = [pytest.mark.fabric, pytest.mark.slow]

MODEL = "smollm2-135m"
# Fields outside the API's types that a choice may carry: our `token_ids` extension.
EXTENSIONS = {"token_ids"}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string"},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     "required": ["city", "weather", "days"], "additionalProperties": False},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "first": {"type": "string"}, "last": {"type": "string"}},
            "required": ["first", "last"], "additionalProperties": False},
        "admin": {"type": "boolean"}},
     "required": ["person", "admin"], "additionalProperties": False},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}]


def strictly(kind: type[BaseModel], payload: dict[str, Any]) -> BaseModel:
    """`payload` as the API's type, refusing fields the type does not declare (beyond
    `EXTENSIONS` in a choice)."""
    parsed = kind.model_validate(payload)
    _no_extras(parsed, kind.__name__)
    return parsed


def _no_extras(value: object, where: str) -> None:
    if isinstance(value, BaseModel):
        extra = set(value.model_extra or {}) - (EXTENSIONS if where.endswith("]") else set())
        assert not extra, f"{where}: fields outside the API's types: {sorted(extra)}"
        for name in type(value).model_fields:
            _no_extras(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _no_extras(item, f"{where}[{i}]")


def raw_chat(server: Server, **body: Any) -> dict[str, Any]:  # noqa: ANN401
    status, reply = server.post("/v1/chat/completions", json.dumps(
        {"model": MODEL, "temperature": 0, **body}).encode())
    assert status == 200, reply
    return reply


def single_node(loaded: LoadedModel, ids: list[int], params: SamplingParams) -> list[int]:
    """The same request on one engine in this process, with its own grammar compiler."""
    config = EngineConfig(loaded.config, CacheConfig(page_size=16, num_pages=256))
    engine = LLMEngine(EngineParts.build(config, load_transformer(config, loaded.state_dict),
                                         GuideCompiler.for_model(loaded)))
    [request] = engine.generate([ids], params)
    return request.output_token_ids


def chat_ids(loaded: LoadedModel, messages: list[dict[str, Any]]) -> list[int]:
    assert loaded.chat_template is not None and loaded.tokenizer is not None
    return ChatTemplate.for_tokenizer(loaded.chat_template, loaded.tokenizer).render_ids(
        messages, loaded.tokenizer)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "enum-array", "nested"])
def test_json_schema_output_validates_and_equals_a_single_node(
        server: Server, smollm2_model: LoadedModel, schema: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "Describe something as JSON."}]
    reply = raw_chat(server, messages=messages, max_tokens=80, response_format={
        "type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                               "strict": True}})
    choice = strictly(ChatCompletion, reply).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)
    params = SamplingParams(max_tokens=80, guide=Guide(GuideKind.JSON_SCHEMA,
                                                       json.dumps(schema)))
    expected = single_node(smollm2_model, chat_ids(smollm2_model, messages), params)
    assert reply["choices"][0]["token_ids"] == expected


def test_json_object_and_the_extensions_follow_their_grammar(server: Server) -> None:
    messages = [{"role": "user", "content": "Answer."}]
    choice = raw_chat(server, messages=[{"role": "user", "content": "Give a point as JSON with "
                                                                    "x and y."}],
                      max_tokens=120, response_format={"type": "json_object"})["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)
    text = raw_chat(server, messages=messages, max_tokens=12,
                    guided_regex="(yes|no), [0-9]{2}")["choices"][0]["message"]["content"]
    assert text[:3] in ("yes", "no,") and text[-2:].isdigit()
    text = raw_chat(server, messages=messages, max_tokens=12,
                    guided_choice=["red", "green", "blue"])["choices"][0]["message"]["content"]
    assert text in ("red", "green", "blue")


def test_a_schema_that_cannot_compile_is_a_400_naming_the_field(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        server.client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {
                    "x": {"type": "string", "pattern": "(unclosed"}}}}})
    assert caught.value.body["param"] == "response_format"


def test_chat_logprobs_equal_transformers(server: Server, smollm2_model: LoadedModel,
                                          hf_smollm2_model: Any) -> None:
    """Each token's logprob and its top 3: log_softmax of transformers' logits on the same
    ids, within 2e-3 (two fp32 implementations; SmolLM2's logits reach about 30)."""
    messages = [{"role": "user", "content": "Name a color."}]
    reply = raw_chat(server, messages=messages, max_tokens=8, logprobs=True, top_logprobs=3)
    choice = strictly(ChatCompletion, reply).choices[0]
    ids = chat_ids(smollm2_model, messages) + reply["choices"][0]["token_ids"]
    with torch.inference_mode():
        reference = torch.log_softmax(hf_smollm2_model(torch.tensor([ids])).logits[0].float(), -1)
    tokenizer = smollm2_model.tokenizer
    start = len(ids) - len(reply["choices"][0]["token_ids"])
    for i, entry in enumerate(choice.logprobs.content):
        token_id = ids[start + i]
        row = reference[start + i - 1]
        assert entry.bytes == list(tokenizer.token_bytes(token_id))
        assert abs(entry.logprob - float(row[token_id])) < 2e-3
        top = torch.topk(row, 3)
        assert [t.bytes for t in entry.top_logprobs] == [
            list(tokenizer.token_bytes(t)) for t in top.indices.tolist()]


def test_completion_logprobs_are_the_apis_object(server: Server) -> None:
    status, reply = server.post("/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "temperature": 0,
         "logprobs": 2}).encode())
    assert status == 200, reply
    logprobs = strictly(Completion, reply).choices[0].logprobs
    assert "".join(logprobs.tokens) == reply["choices"][0]["text"]
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_a_tool_call_round_trip(server: Server) -> None:
    """tool_choice "required": SmolLM2 calls the tool (enforced by its schema); then, given
    the result, it answers in text."""
    client = server.client
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in "
                                                                  "Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           tool_choice="required", max_tokens=60,
                                           temperature=0)
    strictly(ChatCompletion, first.model_dump(exclude_unset=True))
    [call] = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, TOOLS[0]["function"]["parameters"])
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=30, temperature=0)
    assert final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")


def test_streamed_tool_calls_equal_the_whole_answer(server: Server) -> None:
    body = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60}
    whole = raw_chat(server, **body)["choices"][0]
    status, text = server.post_raw("/v1/chat/completions", json.dumps(
        {"model": MODEL, "temperature": 0, "stream": True, **body}).encode())
    assert status == 200
    chunks = [strictly(ChatCompletionChunk, json.loads(line[6:]))
              for line in text.splitlines() if line.startswith("data: {")]
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"])
        for c in whole["message"]["tool_calls"]]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" == whole["finish_reason"]


def test_n_choices_are_forks_of_one_request(server: Server) -> None:
    """n = 3 greedy: three equal choices; seeded sampling: choice 0 is the unforked request's
    and the others differ; usage counts every choice; the decoder's pages all come back. (One
    prefill and one transfer: tests/disagg/node/test_parallel_samples.py.)"""
    prompt = "List three fruits:"
    greedy = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                              temperature=0, n=3)
    strictly(Completion, greedy.model_dump(exclude_unset=True))
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in greedy.choices)
    sampled = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                               temperature=1.0, seed=5, n=3)
    alone = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                             temperature=1.0, seed=5)
    assert sampled.choices[0].text == alone.choices[0].text
    assert len({c.text for c in sampled.choices}) > 1
    assert decoder_pages_in_use(server) == 0


def test_n_choices_stream_with_their_index_and_stop_alone(server: Server) -> None:
    """Streamed n = 2 sampled: chunks carry each choice's index; a stop string ends its
    choice alone (its fork is aborted on the decoder), the other goes on."""
    stream = server.client.completions.create(model=MODEL, prompt="Count: 1, 2,", n=2,
                                              max_tokens=20, temperature=1.0, seed=3,
                                              stop=[","], stream=True)
    reasons: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert set(reasons) == {0, 1}
    assert decoder_pages_in_use(server) == 0


def decoder_pages_in_use(server: Server) -> float:
    for _ in range(50):  # the decoder frees a request's pages as it reports its end
        used = sum(v for k, v in server.metrics().items()
                   if "kv_pages_in_use" in k and "decode" in k)
        if used == 0:
            return 0
        time.sleep(0.1)
    return used
