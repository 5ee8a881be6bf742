"""What a structured-output request asks for (`Guide`) and its translation into an llguidance
grammar: OpenAI's `response_format` (json_object, json_schema) and vLLM's guided_regex,
guided_choice and guided_grammar, plus a tagged JSON value for tool calls (S8, X1).

Pure text in, grammar text out: nothing here knows a tokenizer or a vocabulary (that is
`guided.py`), so the front door, the wire and the sampler can all name a `Guide`. Every spec
that cannot be read raises `GuideError` naming what is wrong.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import llguidance

from disagg.errors import GuideError

# JSON whitespace between tokens is free, but bounded: a small model left free to pick
# whitespace can emit newlines until max_tokens. 24 characters still pretty-prints
# (indent 2) eleven levels deep.
WHITESPACE_MAX = 24
_WHITESPACE = rf"[\x20\x0A\x0D\x09]{{0,{WHITESPACE_MAX}}}"


class GuideKind(enum.Enum):
    """What a `Guide`'s spec is."""

    JSON_OBJECT = "json_object"  # any JSON object; spec ""
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    REGEX = "regex"  # spec: a regular expression (Rust `regex` syntax) the whole output matches
    CHOICE = "choice"  # spec: a JSON list of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # spec: llguidance's Lark dialect, or llama.cpp's GBNF (converted)
    TAGGED_JSON = "tagged_json"  # spec: {"begin": str, "schema": {...}, "end": str} as JSON


@dataclass(frozen=True, slots=True)
class Guide:
    """The grammar a request's output must follow.

    `strict` is OpenAI's json_schema `strict`: True refuses (GuideError) a schema keyword the
    library cannot enforce (`not`, `if`/`then`, `uniqueItems`, ...); False ignores such
    keywords, so the output may break them. Other kinds are always exact.
    """

    kind: GuideKind
    spec: str = ""
    strict: bool = True


def grammar_of(guide: Guide) -> str:
    """The llguidance grammar (its JSON form) for `guide`; GuideError if the spec is malformed.

    Compile errors (a bad regex, an unknown rule, an unsupported keyword) only show when the
    grammar is compiled against a tokenizer (`GuideCompiler`).
    """
    kind, spec = guide.kind, guide.spec
    options = {"whitespace_pattern": _WHITESPACE, "lenient": not guide.strict}
    if kind is GuideKind.JSON_OBJECT:
        if spec:
            raise GuideError("json_object takes no spec (use json_schema for a schema)")
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             overrides=options)
    if kind is GuideKind.JSON_SCHEMA:
        schema = _parse(spec, "json_schema")
        if not isinstance(schema, dict | bool):
            raise GuideError(f"json_schema: a schema is a JSON object, got {_kind_of(schema)}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind is GuideKind.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind is GuideKind.CHOICE:
        choices = _parse(spec, "choice")
        if not (isinstance(choices, list) and choices
                and all(isinstance(c, str) and c for c in choices)):
            raise GuideError("choice: the spec must be a non-empty JSON list of non-empty "
                             "strings")
        # Lark string literals take JSON's escapes.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    if kind is GuideKind.GRAMMAR:
        try:
            return llguidance.grammar_from("grammar", spec)
        except ValueError as error:  # GBNF that does not convert
            raise GuideError(f"grammar: {error}") from None
    if kind is GuideKind.TAGGED_JSON:
        return llguidance.LLMatcher.grammar_from_lark(_tagged_lark(spec, options))
    raise GuideError(f"unknown guide kind {kind!r}")


def _tagged_lark(spec: str, options: dict[str, Any]) -> str:
    tagged = _parse(spec, "tagged_json")
    if not isinstance(tagged, dict) or set(tagged) != {"begin", "schema", "end"}:
        raise GuideError('tagged_json: the spec must be a JSON object with exactly "begin", '
                         '"schema" and "end"')
    begin, schema, end = tagged["begin"], tagged["schema"], tagged["end"]
    if not (isinstance(begin, str) and isinstance(end, str)):
        raise GuideError("tagged_json: begin and end must be strings")
    if not isinstance(schema, dict):
        raise GuideError(f"tagged_json: schema must be a JSON object, got {_kind_of(schema)}")
    # Inside Lark, a %json value takes its compile options from the schema's "x-guidance".
    schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
    return (f"start: {json.dumps(begin)} value {json.dumps(end)}\n"
            f"value: %json {json.dumps(schema)}")


def _parse(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except ValueError as error:
        raise GuideError(f"{kind}: the spec is not valid JSON: {error}") from None


def _kind_of(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number",
            type(None): "null"}.get(type(value), type(value).__name__)
