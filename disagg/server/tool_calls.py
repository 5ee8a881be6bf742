"""OpenAI tool calls on the way out: find the model's `<tool_call>` blocks in its answer.

`parse_tool_calls` reads a whole answer; `ToolCallStream` reads it delta by delta and gives
the same content and calls however the text is cut. Model output never raises: a block that
is not a call stays in the content as text. Both run in time linear in the text (X5b). What
the model is told, and the validation of `tools`, live in `tool_prompt.py` (re-exported here,
so the HTTP layer has one module to import).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from disagg.server.tool_prompt import (
    CALL_CLOSE,
    CALL_OPEN,
    call_guide_spec,
    check_tools,
    render_tool_messages,
)

__all__ = ["ToolCallStream", "call_guide_spec", "check_tools", "finish_reason",
           "parse_tool_calls", "render_tool_messages"]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """`(content, calls)` of a whole answer: the OpenAI tool call dicts of its blocks, in order,
    and the text around them, stripped (None if nothing is left).

    >>> content, calls = parse_tool_calls('On it.\\n<tool_call>\\n{"name": "f", "arguments": '
    ...                                   '{"x": 1}}\\n</tool_call>')
    >>> content, calls[0]["function"]
    ('On it.', {'name': 'f', 'arguments': '{"x": 1}'})
    """
    stream = ToolCallStream()
    deltas = stream.feed(text) + stream.flush()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    for call in calls:
        del call["index"]  # a stream's field; a message's calls are a plain list
    return content or None, calls


class ToolCallStream:
    """Splits a streamed answer into content deltas and tool call deltas.

    NOTE on the invariant: outside a block, the text held back is the longest suffix that is
    a proper prefix of `<tool_call>` (it may still become one) plus the whitespace after the
    last content emitted (it may turn out to end the content, which the whole parser strips);
    inside a block, everything since `<tool_call>` is held until `</tool_call>` decides
    whether it was a call. Everything else has been emitted, so the deltas of any cutting of
    a text add up to `parse_tool_calls` of the whole. Held text is kept as a list of pieces,
    so each character is copied a bounded number of times.

    Each delta is ``{"content": ...}`` or ``{"tool_calls": [{"index": i, "id": ..., "type":
    "function", "function": {"name": ..., "arguments": ...}}]}`` (one call, whole); `num_calls`
    counts the calls so far, for `finish_reason`.
    """

    def __init__(self) -> None:
        self._inside = False
        self._partial = ""  # outside: a possible start of CALL_OPEN (shorter than it)
        self._body: list[str] = []  # inside: the block's text so far
        self._tail = ""  # inside: the last len(CALL_CLOSE) - 1 characters of the body
        self._space: list[str] = []  # whitespace after the last content emitted
        self._started = False  # whether any content was emitted (leading space is dropped)
        self._content_run: list[str] = []  # content since the last delta was closed
        self._deltas: list[dict[str, Any]] = []
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that `text` (the next piece of the answer) completes."""
        # Steps move an index through `text` rather than slicing off the rest, so that an
        # answer of many blocks costs linear time.
        text, self._partial = self._partial + text, ""
        pos = 0
        while pos < len(text):
            pos = self._inside_step(text, pos) if self._inside else self._outside_step(text, pos)
        return self._take()

    def flush(self) -> list[dict[str, Any]]:
        """The deltas of what is still held, once the answer has ended; a block left open is
        content, and trailing whitespace is dropped."""
        self._content(CALL_OPEN + "".join(self._body) if self._inside else self._partial)
        self._inside, self._partial, self._body, self._space = False, "", [], []
        return self._take()

    def _outside_step(self, text: str, pos: int) -> int:
        """Consume `text[pos:]` up to the next block's body; return where the body starts."""
        start = text.find(CALL_OPEN, pos)
        if start >= 0:
            self._content(text[pos:start])
            self._inside, self._body, self._tail = True, [], ""
            return start + len(CALL_OPEN)
        keep = len(text) - min(_partial_open(text), len(text) - pos)
        self._content(text[pos:keep])
        self._partial = text[keep:]
        return len(text)

    def _inside_step(self, text: str, pos: int) -> int:
        """Consume `text[pos:]` up to the end of the block; return where the block ends."""
        # CALL_CLOSE may have begun in the body held from earlier pieces (`_tail`); `cut` is
        # where it starts in `text`, below `pos` if so.
        head = self._tail + text[pos:pos + len(CALL_CLOSE) - 1]
        in_head = head.find(CALL_CLOSE)
        cut = pos + in_head - len(self._tail) if in_head >= 0 else text.find(CALL_CLOSE, pos)
        if in_head < 0 and cut < 0:
            self._body.append(text[pos:])
            self._tail = (self._tail + text[max(pos, len(text) - len(CALL_CLOSE)):])[
                -(len(CALL_CLOSE) - 1):]
            return len(text)
        body = "".join([*self._body, text[pos:max(cut, pos)]])
        body = body[:len(body) - max(pos - cut, 0)]
        self._inside, self._body, self._tail = False, [], ""
        call = _call(body)
        if call is None:
            self._content(CALL_OPEN + body + CALL_CLOSE)
        else:
            self._close_content()
            self._deltas.append({"tool_calls": [{"index": self.num_calls, **call}]})
            self.num_calls += 1
        return cut + len(CALL_CLOSE)

    def _content(self, text: str) -> None:
        if not self._started:
            text = text.lstrip()
        core = text.rstrip()
        if not core:
            if text:
                self._space.append(text)
            return
        self._content_run += [*self._space, core]
        self._space = [text[len(core):]]
        self._started = True

    def _close_content(self) -> None:
        if self._content_run:
            self._deltas.append({"content": "".join(self._content_run)})
            self._content_run = []

    def _take(self) -> list[dict[str, Any]]:
        self._close_content()
        deltas, self._deltas = self._deltas, []
        return deltas


def _partial_open(text: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of CALL_OPEN."""
    for size in range(min(len(text), len(CALL_OPEN) - 1), 0, -1):
        if text.endswith(CALL_OPEN[:size]):
            return size
    return 0


def _call(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call of a block's `body`, or None if it is not one: JSON with a string
    `name` and an object `arguments` (or JSON text of an object, kept as written)."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return None
    arguments = parsed.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            return None
        if not isinstance(decoded, dict):
            return None
    elif isinstance(arguments, dict):
        arguments = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": parsed["name"], "arguments": arguments}}


def finish_reason(calls_seen: int, reason: str | None) -> str | None:
    """The choice's finish_reason: "tool_calls" if the answer made a call and ended by itself
    ("stop"); otherwise the generation's `reason`, so that "length" still says it was cut."""
    return "tool_calls" if calls_seen > 0 and reason == "stop" else reason
