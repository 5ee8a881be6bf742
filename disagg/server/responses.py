"""The OpenAI API's response objects and stream chunks, as plain dicts (field names as in the
API reference), and the server-sent-events framing of a stream."""

from __future__ import annotations

import json
import time
from typing import Any


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    text = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The usage object; `cached_tokens`: prompt tokens found in the decoder's prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Envelope:
    """The fields every object of one response shares: id, object, created, model."""

    def __init__(self, prefix: str, request_id: str, model: str) -> None:
        self.id = f"{prefix}-{request_id}"
        self.created = int(time.time())
        self.model = model

    def wrap(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:  # noqa: ANN401
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def choice(finish_reason: str | None, token_ids: list[int] | None = None,
           **fields: Any) -> dict[str, Any]:  # noqa: ANN401
    """One choice: `fields` (text, message or delta), then `logprobs` and `finish_reason`;
    `token_ids` is an extension (the ids behind the text), left out when None."""
    made: dict[str, Any] = {"index": 0, **fields, "logprobs": None,
                            "finish_reason": finish_reason}
    if token_ids is not None:
        made["token_ids"] = token_ids
    return made


def completion_choice(text: str, finish_reason: str | None,
                      token_ids: list[int] | None = None) -> dict[str, Any]:
    return choice(finish_reason, token_ids, text=text)


def chat_choice(content: str, finish_reason: str | None,
                token_ids: list[int] | None = None) -> dict[str, Any]:
    return choice(finish_reason, token_ids, message={"role": "assistant", "content": content})


def chat_delta(delta: dict[str, str], finish_reason: str | None,
               token_ids: list[int] | None = None) -> dict[str, Any]:
    return choice(finish_reason, token_ids, delta=delta)


def model_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "disagg"}]}
