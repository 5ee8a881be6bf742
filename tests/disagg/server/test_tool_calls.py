"""OpenAI tool calls (`disagg.server.tool_prompt`, `tool_calls`): validation, prompts, parsing.

The prompt tests render SmolLM2's own chat template (copied here, checked against the GGUF by
one slow test) and a small Qwen-style one that has a tool section. The parser tests check
every call and delta against the `openai` package's own types, and the stream against the
whole-answer parser at every cut of the same text.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageToolCall, ChatCompletionToolParam
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import TypeAdapter

from disagg.model.loading.registry import LoadedModel
from disagg.server.chat_template import ChatTemplate
from disagg.server.errors import InvalidRequest
from disagg.server.tool_calls import (
    ToolCallStream,
    call_guide_spec,
    check_tools,
    finish_reason,
    parse_tool_calls,
    render_tool_messages,
)
from disagg.server.tool_prompt import has_tool_section

# SmolLM2-135M-Instruct's chat template, as its GGUF carries it: no tool section.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# The shape of Qwen2.5's tool section: the tools as JSON, past calls with object arguments.
QWEN_STYLE_TEMPLATE = (
    "{% if tools %}TOOLS:{% for tool in tools %}{{ tool | tojson }};{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<call>{{ call.function.name }} "
    "{{ call.function.arguments | tojson }}</call>{% endfor %}{{ '\\n' }}{% endfor %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"id": "call_2", "type": "function",
                "function": {"name": "get_time", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
           {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]


def _render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
            tool_choice: object = None) -> str:
    chat, kwargs = render_tool_messages(messages, tools, template, tool_choice)
    return ChatTemplate(template, None, None).render(chat, **kwargs)


def _bad(param: str, tools: object = TOOLS, tool_choice: object = None,
         parallel_tool_calls: object = None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check_tools(tools, tool_choice, parallel_tool_calls)
    assert caught.value.param == param


# Validation.

def test_valid_tools_pass_and_are_openai_tool_params() -> None:
    for tool in TOOLS:
        TypeAdapter(ChatCompletionToolParam).validate_python(tool)
    for choice in (None, "none", "auto", "required",
                   {"type": "function", "function": {"name": "get_time"}}):
        check_tools(TOOLS, choice, True)


def test_no_tools_allow_none_and_auto() -> None:
    for tools in (None, []):
        check_tools(tools, "auto", None)
        check_tools(tools, "none", False)


@pytest.mark.parametrize(("tools", "param"), [
    ({"type": "function"}, "tools"),
    ([WEATHER] * 129, "tools"),
    ([WEATHER, "get_time"], "tools[1]"),
    ([WEATHER, {"type": "retrieval", "function": {"name": "f"}}], "tools[1].type"),
    ([WEATHER, {"type": "function"}], "tools[1].function"),
    ([WEATHER, {"type": "function", "function": {"name": "get time"}}],
     "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f" * 65}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": 7}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "description": 1}}],
     "tools[0].function.description"),
    ([{"type": "function", "function": {"name": "f", "parameters": "object"}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "strict": "yes"}}],
     "tools[0].function.strict"),
])
def test_bad_tool_names_its_field(tools: object, param: str) -> None:
    _bad(param, tools=tools)


@pytest.mark.parametrize(("tools", "tool_choice", "param"), [
    (None, "required", "tool_choice"),
    ([], {"type": "function", "function": {"name": "get_time"}}, "tool_choice.function.name"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}},
     "tool_choice.function.name"),
    (TOOLS, {"type": "function"}, "tool_choice.function.name"),
    (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice.type"),
    (TOOLS, "always", "tool_choice"),
    (TOOLS, 1, "tool_choice"),
])
def test_bad_tool_choice_names_its_field(tools: object, tool_choice: object,
                                         param: str) -> None:
    _bad(param, tools=tools, tool_choice=tool_choice)


def test_parallel_tool_calls_must_be_a_boolean() -> None:
    _bad("parallel_tool_calls", parallel_tool_calls="yes")


# Rendering, for a template without a tool section (SmolLM2's).

@pytest.mark.slow
def test_smollm2_template_is_the_one_copied_here(smollm2_model: LoadedModel) -> None:
    assert smollm2_model.chat_template == SMOLLM2_TEMPLATE
    assert not has_tool_section(SMOLLM2_TEMPLATE)


def test_template_without_tool_section_gets_tools_in_a_system_message() -> None:
    chat, kwargs = render_tool_messages(ASK, TOOLS, SMOLLM2_TEMPLATE)
    assert kwargs == {}
    text = ChatTemplate(SMOLLM2_TEMPLATE, None, None).render(chat)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert "get_weather" in system
    assert "get_time" in system
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(TIME)}\n</tools>" in system
    assert ('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>") in system
    assert "<|im_start|>user\nWeather in Paris?<|im_end|>" in text


def test_tools_are_merged_into_an_existing_system_message() -> None:
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    text = _render(SMOLLM2_TEMPLATE, messages, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert text.count("<|im_start|>system") == 1


def test_past_calls_and_results_become_plain_turns() -> None:
    text = _render(SMOLLM2_TEMPLATE, HISTORY, TOOLS)
    assert (f"<|im_start|>assistant\n{CALL}\n<tool_call>\n"
            '{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response>\n"
            "<tool_response>\n14:05\n</tool_response><|im_end|>") in text
    assert "<|im_start|>tool" not in text


def test_tool_choice_none_shows_no_tools() -> None:
    chat, kwargs = render_tool_messages(ASK, TOOLS, SMOLLM2_TEMPLATE, "none")
    assert (chat, kwargs) == (ASK, {})
    assert "<tools>" not in _render(QWEN_STYLE_TEMPLATE, ASK, TOOLS, "none")


def test_malformed_past_call_names_its_field() -> None:
    messages = [*ASK, {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c", "type": "function", "function": {}}]}]
    with pytest.raises(InvalidRequest) as caught:
        render_tool_messages(messages, TOOLS, SMOLLM2_TEMPLATE)
    assert caught.value.param == "messages[1].tool_calls[0].function.name"


# Rendering, for a template with a tool section (Qwen-style).

def test_template_with_tool_section_receives_tools() -> None:
    assert has_tool_section(QWEN_STYLE_TEMPLATE)
    chat, kwargs = render_tool_messages(ASK, TOOLS, QWEN_STYLE_TEMPLATE)
    assert (chat, kwargs) == (ASK, {"tools": TOOLS})
    text = ChatTemplate(QWEN_STYLE_TEMPLATE, None, None).render(chat, **kwargs)
    assert text == f"TOOLS:{json.dumps(WEATHER)};{json.dumps(TIME)};\nuser:Weather in Paris?\n"


def test_template_with_tool_section_gets_past_calls_with_object_arguments() -> None:
    chat, _ = render_tool_messages(HISTORY, TOOLS, QWEN_STYLE_TEMPLATE)
    assert [m["role"] for m in chat] == ["user", "assistant", "tool", "tool"]
    assert chat[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    text = _render(QWEN_STYLE_TEMPLATE, HISTORY, TOOLS)
    assert 'assistant:<call>get_weather {"city": "Paris"}</call><call>get_time {}</call>' in text


def test_the_word_tools_in_a_string_is_not_a_tool_section() -> None:
    assert not has_tool_section("{{ 'no tools here' }}{# tools #}<tools>")


# Parsing a whole answer.

def test_one_call() -> None:
    content, calls = parse_tool_calls(CALL)
    assert content is None
    assert [c["function"] for c in calls] == [{"name": "get_weather",
                                               "arguments": '{"city": "Paris"}'}]
    assert re.fullmatch(r"call_[0-9a-f]{24}", calls[0]["id"])
    assert calls[0]["type"] == "function"


def test_two_calls_in_order_with_distinct_ids() -> None:
    _, calls = parse_tool_calls(f'{CALL}\n<tool_call>{{"name": "get_time", "arguments": {{}}}}'
                                "</tool_call>")
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert calls[1]["function"]["arguments"] == "{}"
    assert calls[0]["id"] != calls[1]["id"]


def test_arguments_given_as_json_text_are_kept_as_written() -> None:
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\":1}"}'
                                "</tool_call>")
    assert calls[0]["function"]["arguments"] == '{"a":1}'


@pytest.mark.parametrize("block", [
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": 1, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
    '<tool_call>["f", {}]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}}',  # never closed
])
def test_a_block_that_is_not_a_call_stays_content(block: str) -> None:
    assert parse_tool_calls(f"Sure. {block}") == (f"Sure. {block}", [])


def test_content_around_calls_is_kept_and_stripped() -> None:
    content, calls = parse_tool_calls(f"  Let me look.\n{CALL}\nThen I answer. \n")
    assert content == "Let me look.\n\nThen I answer."
    assert len(calls) == 1


def test_answer_without_calls_is_its_content() -> None:
    assert parse_tool_calls(" Paris is sunny. ") == ("Paris is sunny.", [])
    assert parse_tool_calls(" \n") == (None, [])


def test_finish_reason_says_tool_calls_only_when_the_answer_ended_with_a_call() -> None:
    assert finish_reason(1, "stop") == "tool_calls"
    assert finish_reason(0, "stop") == "stop"
    assert finish_reason(2, "length") == "length"


# Parsing a stream.

SAMPLES = [
    f"Let me look.\n{CALL}\n{CALL} done",
    f"{CALL}<tool_call>bad</tool_call>  <tool_<tool_call>{{}}</tool_call>",
    "a < b <tool_ca and <tool_call>{\"name\": \"f\", \"arguments\": \"{}\"}</tool_cal",
    f" {CALL} </tool_call> <tool_call> x </tool_call>",
]


def _streamed(pieces: list[str]) -> tuple[str | None, list[dict[str, Any]],
                                          list[dict[str, Any]]]:
    stream = ToolCallStream()
    deltas = [d for piece in pieces for d in stream.feed(piece)] + stream.flush()
    content = "".join(d.get("content", "") for d in deltas) or None
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    return content, calls, deltas


def _same_answer(text: str, pieces: list[str]) -> None:
    content, calls = parse_tool_calls(text)
    streamed_content, streamed_calls, _ = _streamed(pieces)
    assert streamed_content == content
    assert [c["index"] for c in streamed_calls] == list(range(len(calls)))
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_cut_anywhere_matches_the_whole_answer(text: str) -> None:
    for cut in range(len(text) + 1):
        _same_answer(text, [text[:cut], text[cut:]])
    _same_answer(text, list(text))


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "<", "/", " ", "\n", "x", CALL,
             '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "arguments": "{}"}']


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12), st.data())
def test_stream_of_any_cutting_matches_the_whole_answer(fragments: list[str],
                                                        data: st.DataObject) -> None:
    text = "".join(fragments)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    bounds = [0, *cuts, len(text)]
    _same_answer(text, [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])


def test_stream_emits_content_up_to_a_possible_call_start() -> None:
    stream = ToolCallStream()
    assert stream.feed("Looking <tool") == [{"content": "Looking"}]
    assert stream.feed("box> now") == [{"content": " <toolbox> now"}]


def test_calls_and_deltas_are_openai_types() -> None:
    for text in SAMPLES:
        for call in parse_tool_calls(text)[1]:
            ChatCompletionMessageToolCall.model_validate(call)
        for delta in _streamed(list(text))[2]:
            ChoiceDelta.model_validate(delta)


# Forcing a call.

def _valid(schema: dict[str, Any], call: object) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(call)


def test_named_function_spec_accepts_its_call_only() -> None:
    spec = call_guide_spec(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert spec is not None
    assert (spec["begin"], spec["end"]) == ("<tool_call>\n", "\n</tool_call>")
    jsonschema.Draft202012Validator.check_schema(spec["schema"])
    assert _valid(spec["schema"], {"name": "get_weather", "arguments": {"city": "Paris"}})
    assert not _valid(spec["schema"], {"name": "get_time", "arguments": {"city": "Paris"}})
    assert not _valid(spec["schema"], {"name": "get_weather", "arguments": {}})
    assert not _valid(spec["schema"], {"name": "get_weather", "arguments": {"city": "P"},
                                       "extra": 1})


def test_required_spec_accepts_any_listed_tool() -> None:
    spec = call_guide_spec(TOOLS, "required")
    assert spec is not None
    assert _valid(spec["schema"], {"name": "get_time", "arguments": {"any": "thing"}})
    assert _valid(spec["schema"], {"name": "get_weather", "arguments": {"city": "Paris"}})
    assert not _valid(spec["schema"], {"name": "get_date", "arguments": {}})


def test_free_choices_have_no_spec() -> None:
    assert call_guide_spec(TOOLS, "auto") is None
    assert call_guide_spec(TOOLS, "none") is None
    assert call_guide_spec(TOOLS, None) is None


def test_text_that_follows_the_spec_parses_as_one_call() -> None:
    spec = call_guide_spec(TOOLS, "required")
    assert spec is not None
    body = {"name": "get_weather", "arguments": {"city": "Paris"}}
    content, calls = parse_tool_calls(spec["begin"] + json.dumps(body) + spec["end"])
    assert content is None
    assert json.loads(calls[0]["function"]["arguments"]) == body["arguments"]
