"""`POST /tokenize`, `POST /detokenize` and `GET /version`: what clients of vLLM-compatible
servers expect besides the OpenAI API (vLLM's paths and shapes, hence not under /v1).

Tokenize answers the very ids a completion would send: it goes through the front door's own
`prompt_ids` and `chat_ids`, with their length checks, after the same body limit and JSON
validation as the completions routes, in the same worker threads. Detokenize is the
tokenizer's `decode` with special tokens kept, as vLLM's is. Nothing here reaches the cluster.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from disagg.config import ModelConfig
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server.errors import InvalidRequest, ModelNotFound
from disagg.server.limits import read_body
from disagg.server.openapi import request_body
from disagg.server.protocol import ChatCompletionRequest, parse_body
from disagg.server.tokenize_protocol import DetokenizeRequest, TokenizeRequest

T = TypeVar("T")


class FrontDoor(Protocol):
    """What these routes use of `app.FrontDoor` (named here: app.py imports this module)."""

    model_name: str
    model: ModelConfig
    tokenizer: Tokenizer | None

    @property
    def context_tokens(self) -> int: ...

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T: ...  # noqa: ANN401

    def prompt_ids(self, prompt: str | list[int]) -> list[int]: ...

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]: ...


def install_utility_routes(app: FastAPI, door: FrontDoor, max_body_bytes: int) -> None:
    """Add the three routes to `app`, over `door`; bodies past `max_body_bytes` are a 413."""
    version = package_version()

    # parse_body is typed for the completions bodies; it needs only pydantic's validation
    # and `check_supported`, which these bodies have too.
    @app.post("/tokenize", openapi_extra=request_body(TokenizeRequest))
    async def tokenize(request: Request) -> JSONResponse:
        raw = await read_body(request, max_body_bytes)
        body = await door.off_loop(parse_body, raw, TokenizeRequest)  # type: ignore[arg-type]
        _check_model(door, body.model)
        ids = await door.off_loop(tokenize_ids, door, body)
        return JSONResponse({"count": len(ids), "max_model_len": door.context_tokens,
                             "tokens": ids})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        raw = await read_body(request, max_body_bytes)
        body = await door.off_loop(parse_body, raw, DetokenizeRequest)  # type: ignore[arg-type]
        _check_model(door, body.model)
        return JSONResponse({"prompt": await door.off_loop(detokenize_text, door, body.tokens)})

    @app.get("/version")
    async def version_route() -> JSONResponse:
        return JSONResponse({"version": version})


def tokenize_ids(door: FrontDoor, body: TokenizeRequest) -> list[int]:
    """The ids /v1/completions (a `prompt`) or /v1/chat/completions (`messages`) would send."""
    if body.messages is not None:
        return door.chat_ids(ChatCompletionRequest(
            model=door.model_name, messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            allow_special_tokens=body.allow_special_tokens))
    if door.tokenizer is None:
        raise InvalidRequest(f"model {door.model_name!r} has no tokenizer: it cannot tokenize "
                             "text", "prompt")
    assert body.prompt is not None  # check_supported: one of the two
    return door.prompt_ids(body.prompt)


def detokenize_text(door: FrontDoor, tokens: list[int]) -> str:
    """The text of `tokens`; a 400 naming `tokens` for ids the model's tokenizer cannot spell
    (the library would skip them silently) or more ids than the context holds."""
    tokenizer = door.tokenizer
    if tokenizer is None:
        raise InvalidRequest(f"model {door.model_name!r} has no tokenizer: it cannot turn "
                             "token ids into text", "tokens")
    context = door.model.max_position_embeddings
    if len(tokens) > context:
        raise InvalidRequest(f"{len(tokens)} tokens are more than the model's context of "
                             f"{context}", "tokens")
    vocab = min(door.model.vocab_size, tokenizer.vocab_size)
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary of {vocab}", "tokens")
    return tokenizer.decode(tokens)


def package_version() -> str:
    """disagg's version, as installed (pyproject.toml's)."""
    try:
        return importlib.metadata.version("disagg")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def _check_model(door: FrontDoor, model: str | None) -> None:
    if model is not None and model != door.model_name:
        raise ModelNotFound(model)
