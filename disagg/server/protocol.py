"""The OpenAI API's request bodies, validated: `/v1/completions` and `/v1/chat/completions`.

Field names, types and defaults follow the OpenAI API reference. Fields we do not implement
are accepted only at their "off" value (`n` 1, `logprobs` null, ...), so a client never gets a
silently different answer. Extensions, as vLLM and SGLang take them: `top_k` (0 or -1: off),
`ignore_eos` (load generators ask for exactly `max_tokens`), `stream_options.
continuous_usage_stats` (usage in every chunk). Unknown fields are ignored, as most
OpenAI-compatible servers do, since clients send fields of newer API versions.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from disagg.server.errors import InvalidRequest
from disagg.server.stop_strings import check_stop_strings

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
MaxTokens = Annotated[int, Field(ge=1)]


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
    n: Literal[1] = 1
    logprobs: None = None
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    logit_bias: None = None
    user: str | None = None
    ignore_eos: bool = False

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
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

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

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_body(raw: bytes, kind: type[SamplingFields]) -> Any:  # noqa: ANN401 - `kind`
    """Decode and validate a JSON body; an `InvalidRequest` naming the first bad field."""
    try:
        document = json.loads(raw, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise InvalidRequest(f"the body is not valid JSON: {error}") from None
    if not isinstance(document, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return kind.model_validate(document)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"] if not _is_type_tag(part))
        raise InvalidRequest(f"{param or 'body'}: {first['msg']}", param or None) from None


def _refuse_constant(name: str) -> float:
    raise InvalidRequest(f"{name} is not a number JSON allows")


def _is_type_tag(part: object) -> bool:
    """pydantic names union branches in error locations ("str", "list[int]"): not fields."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def finite(value: float) -> bool:
    return math.isfinite(value)
