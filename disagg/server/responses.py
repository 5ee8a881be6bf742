"""The OpenAI API's response objects and stream chunks, as plain dicts (field names as in the
API reference), and the server-sent-events framing of a stream. Log probabilities come in
the two shapes the API has: the completions' parallel lists and the chat's list of tokens with
their bytes (S8: the decoder computes them, `engine/logprobs.py`)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any, Protocol

from disagg.engine.logprobs import TokenLogprob


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
           logprobs: dict[str, Any] | None = None, index: int = 0,
           **fields: Any) -> dict[str, Any]:  # noqa: ANN401
    """One choice: `fields` (text, message or delta), then `logprobs` and `finish_reason`;
    `token_ids` is an extension (the ids behind the text), left out when None."""
    made: dict[str, Any] = {"index": index, **fields, "logprobs": logprobs,
                            "finish_reason": finish_reason}
    if token_ids is not None:
        made["token_ids"] = token_ids
    return made


def completion_choice(text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                      logprobs: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    return choice(finish_reason, token_ids, logprobs, index, text=text)


def chat_choice(message: dict[str, Any], finish_reason: str | None,
                token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None,
                index: int = 0) -> dict[str, Any]:
    """`message`: the assistant's, e.g. ``{"role": "assistant", "content": "..."}``."""
    return choice(finish_reason, token_ids, logprobs, index, message=message)


def chat_delta(delta: dict[str, Any], finish_reason: str | None,
               token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None,
               index: int = 0) -> dict[str, Any]:
    return choice(finish_reason, token_ids, logprobs, index, delta=delta)


class TokenText(Protocol):
    """What the logprob objects need of a tokenizer (None: a model without one)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...


def token_text(tokenizer: TokenText | None, token_id: int) -> str:
    """One id as the logprob objects show it: its text, or `token_id:<id>` without a
    tokenizer (as vLLM writes ids it cannot spell)."""
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])


def token_bytes(tokenizer: TokenText | None, token_id: int) -> list[int]:
    if tokenizer is None:
        return list(token_text(None, token_id).encode())
    return list(tokenizer.token_bytes(token_id))


def completion_logprobs(logprobs: Sequence[TokenLogprob], tokenizer: TokenText | None,
                        text_offset: int = 0) -> dict[str, Any]:
    """The completions API's `logprobs`: tokens, their logprobs, the top alternatives as
    {text: logprob} and each token's offset in the choice's text (from `text_offset`)."""
    tokens = [token_text(tokenizer, lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top}
                             for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: Sequence[TokenLogprob],
                  tokenizer: TokenText | None) -> dict[str, Any]:
    """The chat API's `logprobs`: each token with its text, logprob, bytes and the top
    alternatives the same way."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_text(tokenizer, token_id), "logprob": logprob,
                "bytes": token_bytes(tokenizer, token_id)}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in logprobs],
            "refusal": None}


def model_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "disagg"}]}
