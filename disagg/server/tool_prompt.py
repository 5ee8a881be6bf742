"""OpenAI tools on the way in: check them, show them to the model, and force a call if asked.

`check_tools` validates `tools`, `tool_choice` and `parallel_tool_calls` (a 400 naming the
field; at most `MAX_TOOLS` tools: X5b). `render_tool_messages` prepares the messages for the
model's chat template: a template with a tool section of its own gets `tools` as a variable;
any other one gets them described in the system message in the Hermes/Qwen convention, and
past calls and results rewritten as plain turns. `call_guide_spec` is the structured-output
spec that makes "required" or a named function a certainty. Reading calls back: `tool_calls.py`.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

from disagg.server.chat_template import validate_messages
from disagg.server.errors import InvalidRequest

# The markers the model is told to write around each call, and `tool_calls.py` looks for.
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
# OpenAI's documented limit on the number of functions in one request.
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n"
    f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}')


def check_tools(tools: object, tool_choice: object, parallel_tool_calls: object) -> None:
    """Return if the three fields are a valid request, else raise `InvalidRequest` naming the
    offending field (e.g. ``tools[1].function.name``). `tools` None or [] means no tools."""
    if tools is not None and (not isinstance(tools, list) or len(tools) > MAX_TOOLS):
        raise InvalidRequest(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    names: set[str] = set()
    for i, tool in enumerate(tools or []):
        name = _check_tool(tool, f"tools[{i}]")
        if name in names:
            raise InvalidRequest(f"tools[{i}].function.name {name!r} is listed twice",
                                 f"tools[{i}].function.name")
        names.add(name)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tool_choice is None or tool_choice in ("none", "auto"):
        return
    if tool_choice == "required":
        if not names:
            raise InvalidRequest("tool_choice 'required' needs at least one tool in tools",
                                 "tool_choice")
        return
    if not isinstance(tool_choice, Mapping):
        raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if tool_choice.get("type") != "function":
        raise InvalidRequest("tool_choice.type must be 'function'", "tool_choice.type")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or name not in names:
        raise InvalidRequest(f"tool_choice.function.name {name!r} names no function in tools",
                             "tool_choice.function.name")


def _check_tool(tool: object, field: str) -> str:
    if not isinstance(tool, Mapping):
        raise InvalidRequest(f"{field} must be an object {{'type': 'function', ...}}", field)
    if tool.get("type") != "function":
        raise InvalidRequest(f"{field}.type must be 'function'", f"{field}.type")
    function = tool.get("function")
    if not isinstance(function, Mapping):
        raise InvalidRequest(f"{field}.function must be an object", f"{field}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequest(f"{field}.function.name must be 1-64 letters, digits, '_' or '-'",
                             f"{field}.function.name")
    for key, kind, what in (("description", str, "a string"),
                            ("parameters", Mapping, "a JSON schema object"),
                            ("strict", bool, "a boolean")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise InvalidRequest(f"{field}.function.{key} must be {what}",
                                 f"{field}.function.{key}")
    return name


def shown_tools(tools: Sequence[Mapping[str, Any]] | None,
                tool_choice: object) -> list[Mapping[str, Any]]:
    """The tools the model is told about: none under tool_choice "none"."""
    return [] if tool_choice == "none" else list(tools or [])


def render_tool_messages(messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None, template_source: str,
                         tool_choice: object = None) -> tuple[list[dict[str, Any]],
                                                              dict[str, Any]]:
    """`(messages, template_kwargs)` to render with the chat template of `template_source`.

    If the template refers to `tools` it knows the format it was trained on: it gets
    ``{"tools": tools}`` in `template_kwargs` and the messages as transformers passes them
    (each past call's `arguments` decoded to an object). Otherwise `template_kwargs` is {}
    and the messages carry everything: the tools in the first system message, each past call
    as assistant text ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, and
    each run of `tool` messages as one user turn of ``<tool_response>`` blocks. Under
    `tool_choice` "none" no tool is shown. Messages are checked by `validate_messages`.
    """
    chat = validate_messages(messages)
    for i, message in enumerate(chat):
        if "tool_calls" in message:
            message["tool_calls"] = _decoded_calls(message["tool_calls"],
                                                   f"messages[{i}].tool_calls")
    shown = shown_tools(tools, tool_choice)
    if has_tool_section(template_source):
        return chat, ({"tools": shown} if shown else {})
    return _plain_turns(chat, shown), {}


def has_tool_section(template_source: str) -> bool:
    """Whether the Jinja source reads a variable `tools` (not just the word in a string)."""
    try:
        return any(kind == "name" and value == "tools"
                   for _, kind, value in jinja2.Environment().lex(template_source))
    except jinja2.TemplateSyntaxError:
        return False  # ChatTemplate refuses such a source at load time


def _decoded_calls(calls: object, field: str) -> list[dict[str, Any]]:
    """Past calls with `function.arguments` an object where it is JSON text: OpenAI sends the
    text, transformers' templates expect the object (they write it with `tojson`)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{field} must be a list of tool calls", field)
    decoded = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{field}[{j}].function.name must be a string",
                                 f"{field}[{j}].function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # not JSON: shown as it is
                arguments = json.loads(arguments)
        decoded.append({**call, "function": {**function, "arguments": arguments}})
    return decoded


def _plain_turns(chat: list[dict[str, Any]],
                 tools: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(chat):
        if message["role"] == "tool":
            response = f"<tool_response>\n{message['content']}\n</tool_response>"
            if i > 0 and chat[i - 1]["role"] == "tool":
                turns[-1]["content"] += "\n" + response  # one user turn per run of results
            else:
                turns.append({"role": "user", "content": response})
        elif "tool_calls" in message:
            calls = message.pop("tool_calls")
            texts = [message["content"]] if message.get("content") else []
            texts += [_call_text(call["function"]) for call in calls]
            turns.append(message | {"content": "\n".join(texts)})
        else:
            turns.append(message)
    if tools:
        section = _TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        section += _TOOLS_INSTRUCTION
        if turns[0]["role"] in ("system", "developer"):
            turns[0]["content"] = f"{turns[0]['content']}\n\n{section}"
        else:
            turns.insert(0, {"role": "system", "content": section})
    return turns


def _call_text(function: Mapping[str, Any]) -> str:
    body = {"name": function["name"], "arguments": function["arguments"]}
    return f"{CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{CALL_CLOSE}"


def call_guide_spec(tools: Sequence[Mapping[str, Any]] | None,
                    tool_choice: object) -> dict[str, Any] | None:
    """The spec that forces exactly one call, for `tool_choice` "required" or a named function:
    ``{"begin": "<tool_call>\\n", "schema": S, "end": "\\n</tool_call>"}`` with S the JSON
    schema of one call object (`anyOf` over every tool for "required"). None otherwise, since
    "auto" and "none" leave the model free. Expects `check_tools` to have passed.
    """
    if tool_choice == "required":
        schema: dict[str, Any] = {"anyOf": [_call_schema(t["function"]) for t in tools or []]}
    elif isinstance(tool_choice, Mapping):
        name = tool_choice["function"]["name"]
        schema = _call_schema(next(t["function"] for t in tools or []
                                   if t["function"]["name"] == name))
    else:
        return None
    return {"begin": f"{CALL_OPEN}\n", "schema": schema, "end": f"\n{CALL_CLOSE}"}


def _call_schema(function: Mapping[str, Any]) -> dict[str, Any]:
    return {"type": "object",
            "properties": {"name": {"const": function["name"]},
                           "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}
