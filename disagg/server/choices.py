"""The choices of one answer, assembled from a `Generation`'s deltas: the text or the chat
message, tool calls parsed out of it, log probabilities, and each choice's finish reason,
whole or as stream chunks (S8: a request's `n` choices are forked on the decoder).

What a choice shows depends on the request (`Shape`): completions carry text and the
completions API's logprobs; chat carries a message (or deltas) and the chat API's logprobs,
and with tools offered the `<tool_call>` blocks of the answer become `tool_calls`
(`tool_calls.py`), with finish reason "tool_calls".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disagg.engine.logprobs import TokenLogprob
from disagg.server import responses
from disagg.server.generation import Delta
from disagg.server.responses import TokenText
from disagg.server.tool_calls import ToolCallStream, finish_reason, parse_tool_calls


@dataclass(frozen=True, slots=True)
class Shape:
    """What the request asked its choices to show."""

    chat: bool
    tokenizer: TokenText | None = None
    logprobs: bool = False  # the request asked for log probabilities
    tools: bool = False  # tools were offered: parse calls out of the answer
    one_call: bool = False  # parallel_tool_calls false: the first call only

    def logprob_object(self, logprobs: list[TokenLogprob], text_offset: int = 0
                       ) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return responses.chat_logprobs(logprobs, self.tokenizer)
        return responses.completion_logprobs(logprobs, self.tokenizer, text_offset)


@dataclass
class WholeChoice:
    """One choice of an answer given whole: its deltas added up."""

    shape: Shape
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.reason = delta.finish_reason or self.reason

    def render(self) -> dict[str, Any]:
        shape, logprobs = self.shape, self.shape.logprob_object(self.logprobs)
        if not shape.chat:
            return responses.completion_choice(self.text, self.reason, self.token_ids,
                                               logprobs, self.index)
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        reason = self.reason
        if shape.tools:
            content, calls = parse_tool_calls(self.text)
            calls = calls[:1] if shape.one_call else calls
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                reason = finish_reason(len(calls), reason)
        return responses.chat_choice(message, reason, self.token_ids, logprobs, self.index)


class StreamedChoice:
    """One choice of a streamed answer: each delta as the stream choices it adds."""

    def __init__(self, shape: Shape, index: int) -> None:
        self.shape = shape
        self.index = index
        self._calls = ToolCallStream() if shape.chat and shape.tools else None
        self._text_offset = 0  # completions' logprobs: where the next token's text starts

    def first(self) -> dict[str, Any]:
        """Chat's opening delta: the assistant's role."""
        return responses.chat_delta({"role": "assistant", "content": ""}, None, index=self.index)

    def chunks(self, delta: Delta) -> list[dict[str, Any]]:
        """The stream choices `delta` adds (several when it completes tool calls)."""
        shape = self.shape
        if not shape.chat:
            logprobs = shape.logprob_object(delta.logprobs, self._text_offset)
            if logprobs is not None:
                self._text_offset += sum(len(t) for t in logprobs["tokens"])
            return [responses.completion_choice(delta.text, delta.finish_reason,
                                                delta.token_ids, logprobs, self.index)]
        logprobs = shape.logprob_object(delta.logprobs)
        if self._calls is None:
            content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
            return [responses.chat_delta(content, delta.finish_reason, delta.token_ids,
                                         logprobs, self.index)]
        pieces = self._calls.feed(delta.text)
        reason = delta.finish_reason
        if reason is not None:
            pieces += self._calls.flush()
            reason = finish_reason(self._calls.num_calls, reason)
        if shape.one_call:
            pieces = [p for p in pieces if "tool_calls" not in p
                      or p["tool_calls"][0]["index"] == 0]
        if not pieces:
            pieces = [{}]  # the tokens' ids and logprobs still go out, or the finish reason
        return [responses.chat_delta(piece, reason if i == len(pieces) - 1 else None,
                                     delta.token_ids if i == 0 else None,
                                     logprobs if i == 0 else None, self.index)
                for i, piece in enumerate(pieces)]
