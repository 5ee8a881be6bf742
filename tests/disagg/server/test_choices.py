"""The choices of an answer from its deltas (`disagg.server.choices`): tool calls parsed out,
one call only under parallel_tool_calls false, logprobs in each API's shape."""

from __future__ import annotations

from openai.types import CompletionChoice
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice

from disagg.engine.logprobs import TokenLogprob
from disagg.server.choices import Shape, StreamedChoice, WholeChoice
from disagg.server.generation import Delta

TWO_CALLS = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n</tool_call>')


def whole(shape: Shape, *deltas: Delta) -> dict:
    choice = WholeChoice(shape, 0)
    for delta in deltas:
        choice.add(delta)
    return choice.render()


def test_calls_are_parsed_out_of_a_chat_answer() -> None:
    rendered = whole(Shape(chat=True, tools=True), Delta(TWO_CALLS, [1, 2], "stop"))
    parsed = ChatChoice.model_validate(rendered)
    assert [c.function.name for c in parsed.message.tool_calls] == ["a", "b"]
    assert parsed.finish_reason == "tool_calls" and parsed.message.content is None


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    shape = Shape(chat=True, tools=True, one_call=True)
    parsed = ChatChoice.model_validate(whole(shape, Delta(TWO_CALLS, [1], "stop")))
    assert [c.function.name for c in parsed.message.tool_calls] == ["a"]
    stream = StreamedChoice(shape, 0)
    chunks = stream.chunks(Delta(TWO_CALLS, [1], "stop"))
    calls = [c for chunk in chunks for c in ChunkChoice.model_validate(chunk).delta.tool_calls
             or []]
    assert [c.function.name for c in calls] == ["a"]


def test_without_tools_the_text_stays_text() -> None:
    parsed = ChatChoice.model_validate(whole(Shape(chat=True), Delta(TWO_CALLS, [1], "stop")))
    assert parsed.message.content == TWO_CALLS and parsed.finish_reason == "stop"


def test_completion_logprobs_offsets_run_across_stream_chunks() -> None:
    class Spelling:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(96 + i) * i for i in ids)

        def token_bytes(self, token_id: int) -> bytes:
            return self.decode([token_id]).encode()

    shape = Shape(chat=False, tokenizer=Spelling(), logprobs=True)
    stream = StreamedChoice(shape, 2)
    first = stream.chunks(Delta("abb", [1, 2], None, [TokenLogprob(1, -0.1), TokenLogprob(
        2, -0.2)], 2))
    second = stream.chunks(Delta("ccc", [3], "length", [TokenLogprob(3, -0.3)], 2))
    assert first[0]["logprobs"]["text_offset"] == [0, 1]  # (a stream's choice has no reason)
    last = CompletionChoice.model_validate(second[0])
    assert last.logprobs.text_offset == [3]
    assert last.index == 2 and last.logprobs.tokens == ["ccc"]
