"""The OpenAI API's request bodies, validated: `/v1/completions` and `/v1/chat/completions`.

Field names, types, ranges and defaults follow the OpenAI API reference. Fields we do not
implement are accepted only at their "off" values (null, `echo` false, `best_of` 1, ...); any
other value is a 400 naming the field (`check_supported`), so a client never gets a silently
different answer (X5b). Extensions, as vLLM and SGLang take them: `top_k` (0 or -1: off),
`ignore_eos`, `min_tokens`, `repetition_penalty`, `stop_token_ids`, the `guided_*` grammars
(structured output on the decoder, S8), `stream_options.continuous_usage_stats`. Unknown
fields are ignored, as most OpenAI-compatible servers do, since clients send fields of newer
API versions. Text that UTF-8 cannot encode (a lone surrogate) is refused naming its field.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from disagg.engine.guide_spec import Guide, GuideKind
from disagg.engine.sampling_params import MAX_LOGPROBS, MAX_N
from disagg.server.errors import InvalidRequest
from disagg.server.stop_strings import check_stop_strings
from disagg.server.tool_prompt import check_tools

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
MaxTokens = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]
TokenId = Annotated[int, Field(ge=0)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int = 0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (as a string) -> bias
    user: str | None = None
    ignore_eos: bool = False
    # vLLM's sampling extensions.
    repetition_penalty: Annotated[float, Field(gt=0.0, le=1e4)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: list[TokenId] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None
    # vLLM's extensions we do not implement: accepted only as null (or their off value
    # below), so a client that relies on one hears so.
    min_p: Literal[0, 0.0] | None = None
    use_beam_search: Literal[False] | None = None
    include_stop_str_in_output: Literal[False] | None = None
    skip_special_tokens: Literal[True] | None = None

    def check_supported(self) -> None:
        """A 400 naming the first field set to a value we do not implement (the types let
        through values that only a rule across fields refuses)."""
        self.logit_bias_pairs()
        self.guide()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true",
                                 "stream_options")

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias); its keys must be token ids."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise InvalidRequest(f"logit_bias: the key {key[:20]!r} is not a token id",
                                     "logit_bias")
            pairs.append((int(key), bias))
        return tuple(pairs)

    def guide(self) -> Guide | None:
        """The grammar the output must follow, from whichever one field asks for one."""
        asked = {name: value for name, value in self.guides().items() if value is not None}
        if len(asked) > 1:
            first, second = list(asked)[:2]
            raise InvalidRequest(f"{first} and {second} both constrain the output: use one",
                                 second)
        return next(iter(asked.values()), None)

    def guides(self) -> dict[str, Guide | None]:
        """Each field that can ask for a grammar, and the grammar it asks for."""
        schema = self.guided_json
        return {
            "guided_json": None if schema is None else Guide(
                GuideKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema)),
            "guided_regex": None if self.guided_regex is None else Guide(
                GuideKind.REGEX, self.guided_regex),
            "guided_choice": None if self.guided_choice is None else Guide(
                GuideKind.CHOICE, json.dumps(self.guided_choice)),
            "guided_grammar": None if self.guided_grammar is None else Guide(
                GuideKind.GRAMMAR, self.guided_grammar)}

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return check_stop_strings(stops)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: MaxTokens | None = 16  # OpenAI's default for completions
    echo: Literal[False] | None = False
    best_of: Literal[1] | None = None
    suffix: Literal[""] | None = None
    logprobs: NumLogprobs | None = None  # 0 is not off here: it asks for the chosen token's

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a batch of prompts is refused: one request, one choice)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest("one prompt per request: batches of prompts are not "
                                     "supported", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        return prompt  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    add_generation_prompt: bool = True  # an extension, as in vLLM and SGLang
    # Ours: let special-token text in message content become special tokens (default: it is
    # plain text, so a user cannot write the template's own markers; X5b).
    allow_special_tokens: bool = False
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[Literal["text"]] | None = None
    audio: None = None
    prediction: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None
    store: Literal[False] | None = None
    # Bookkeeping that does not change the answer: accepted and not used.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        check_tools(self.tools, self.tool_choice, self.parallel_tool_calls)
        if self.functions or self.function_call is not None:
            name = "functions" if self.functions else "function_call"
            _unsupported(name, "the deprecated function calling (use tools)")

    def num_logprobs(self) -> int | None:
        """Top alternatives per token when log probabilities are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def guides(self) -> dict[str, Guide | None]:
        return {**super().guides(), "response_format": response_format_guide(
            self.response_format)}


def response_format_guide(response_format: dict[str, Any] | None) -> Guide | None:
    """OpenAI's `response_format`: text (no grammar), json_object or json_schema."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide(GuideKind.JSON_OBJECT)
    if kind != "json_schema":
        raise InvalidRequest(f"response_format.type must be text, json_object or json_schema, "
                             f"got {str(kind)[:40]!r}", "response_format.type")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequest("response_format.json_schema must be an object with a name",
                             "response_format.json_schema")
    schema = spec.get("schema", {})
    strict = spec.get("strict")
    if not isinstance(schema, dict) or not isinstance(strict, bool | None):
        raise InvalidRequest("response_format.json_schema.schema must be an object and strict "
                             "a boolean", "response_format.json_schema")
    return Guide(GuideKind.JSON_SCHEMA, json.dumps(schema), strict=bool(strict))


def _unsupported(field: str, what: str) -> None:
    raise InvalidRequest(f"{field}: {what} is not supported by this server; leave it unset",
                         field)


def parse_body(raw: bytes, kind: type[SamplingFields]) -> Any:  # noqa: ANN401 - `kind`
    """Decode and validate a JSON body; an `InvalidRequest` naming the first bad field."""
    try:
        document = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InvalidRequest(f"the body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidRequest("the body must be a JSON object")
    _check_encodable(document)
    try:
        body = kind.model_validate(document)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part))
        raise InvalidRequest(f"{param or 'body'}: {first['msg']}", param or None) from None
    body.check_supported()
    return body


def _check_encodable(document: object) -> None:
    """Every string in a JSON document must be valid Unicode text: JSON's `\\udc80` escapes
    decode to lone surrogates, which no tokenizer (nor UTF-8) takes. Iterative: a document as
    deep as `json` allows must not exhaust the stack here."""
    stack: list[tuple[object, tuple[str | int, ...]]] = [(document, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            children: Any = value.items()
        elif isinstance(value, list):
            children = enumerate(value)
        else:
            _check_text(value, path)
            continue
        for key, item in children:
            _check_text(key, path)
            if isinstance(item, str | dict | list):
                stack.append((item, (*path, key)))


def _check_text(value: object, path: tuple[str | int, ...]) -> None:
    if not isinstance(value, str):
        return
    try:
        value.encode()
    except UnicodeEncodeError as error:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
        raise InvalidRequest(f"{where or 'body'}: the text has a lone surrogate at character "
                             f"{error.start}", where or None) from None


def _refuse_constant(name: str) -> float:
    raise InvalidRequest(f"{name} is not a number JSON allows")


def _is_type_tag(part: object) -> bool:
    """pydantic names union branches in error locations ("str", "list[int]"): not fields."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def finite(value: float) -> bool:
    return math.isfinite(value)
