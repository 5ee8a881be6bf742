"""The OpenAI-compatible HTTP API of a cluster: completions, chat completions, models, health
and metrics (FastAPI).

Handlers read the body within its limit, validate it (`protocol.py`), turn the prompt into
token ids, submit through the `ClusterClient` and either stream server-sent events
(`event_stream.py`) or answer once the request ends. Parsing, tokenizing and rendering run in
a small thread pool, after checks that bound their cost, so the event loop keeps answering
everyone else (X5b). A client that disconnects cancels its request's task; the request is then
aborted in the cluster and counted with finish reason "abort". The API key check and the
utility routes (tokenize, detokenize, version) are installed from `api_key.py` and
`utility_routes.py`.
"""

from __future__ import annotations

import asyncio
import time
import contextlib
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from disagg.config import ModelConfig
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server import responses
from disagg.server.api_key import install_api_key
from disagg.server.chat_template import ChatTemplate, require_chat_template
from disagg.server.cluster_client import ClusterClient, Sampling
from disagg.server.errors import APIError, InvalidRequest, ModelNotFound
from disagg.server.event_stream import EventStream
from disagg.server.generation import Delta, Generation, Timings
from disagg.server.http_config import HTTPConfig
from disagg.server.limits import check_prompt_chars, max_token_chars, read_body
from disagg.server.metrics import ServerMetrics
from disagg.server.openapi import install_openapi, request_body
from disagg.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_body,
)
from disagg.server.tokenize_protocol import REQUEST_MODELS as UTILITY_REQUESTS
from disagg.server.utility_routes import install_utility_routes

T = TypeVar("T")
# Threads that parse bodies, tokenize and render templates: a few, so that a burst of big
# prompts queues here instead of taking every core from the event loop and the engines.
WORK_THREADS = 4


@dataclass
class FrontDoor:
    """What the HTTP layer serves: one model, through one cluster."""

    model_name: str
    model: ModelConfig
    tokenizer: Tokenizer | None
    chat_template: ChatTemplate | None
    client: ClusterClient
    metrics: ServerMetrics
    health: Callable[[], tuple[bool, dict[str, Any]]]  # (all nodes answer, the body)
    max_request_tokens: int | None = None  # a decoder's whole cache, when known
    created: int = field(default_factory=lambda: int(time.time()))
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        WORK_THREADS, "front-door-work"))
    _chars_per_token: int | None = field(default=None, init=False, repr=False)

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:  # noqa: ANN401
        """`work(*args)` in the front door's threads; its exceptions are raised here."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, work, *args)

    @property
    def context_tokens(self) -> int:
        """The most tokens one request can hold: the model's context, or a decoder's cache."""
        context = self.model.max_position_embeddings
        return context if self.max_request_tokens is None else min(context,
                                                                    self.max_request_tokens)

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context at any tokenization, before tokenizing it
        (the bound on characters per token is read from the vocabulary once, here in a
        worker thread)."""
        if self.tokenizer is None:
            return
        if self._chars_per_token is None:
            self._chars_per_token = max_token_chars(self.tokenizer)
        check_prompt_chars(num_chars, self.context_tokens, self._chars_per_token, param)

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a completion prompt (worker thread: tokenizing is the slow part)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(f"model {self.model_name!r} has no tokenizer: send the "
                                     "prompt as a list of token ids", "prompt")
            self.check_text_length(len(prompt), "prompt")
            return self.tokenizer.encode(prompt)
        context = self.model.max_position_embeddings  # the cache's own check is `sampling`'s
        if len(prompt) >= context:
            raise InvalidRequest(f"the prompt has {len(prompt)} tokens; the model's context is "
                                 f"{context}", "prompt")
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary of "
                                 f"{self.model.vocab_size}", "prompt")
        return prompt

    def chat_ids(self, body: ChatCompletionRequest) -> list[int]:
        """Token ids of a chat prompt: the template rendered, then tokenized (worker thread).
        The messages' text is a lower bound on the prompt's (a template writes each message),
        so it is checked against the context first."""
        template = require_chat_template(self.model_name, self.chat_template)
        assert self.tokenizer is not None  # a template comes with its tokenizer
        self.check_text_length(sum(_text_length(m.content) for m in body.messages), "messages")
        return template.render_ids([m.model_dump(exclude_none=True) for m in body.messages],
                                   self.tokenizer, body.add_generation_prompt,
                                   body.allow_special_tokens)

    def sampling(self, body: SamplingFields, prompt_len: int, max_tokens: int | None,
                 param: str) -> Sampling:
        context = self.model.max_position_embeddings
        room = context - prompt_len
        if room < 1:
            raise InvalidRequest(f"the prompt has {prompt_len} tokens; the model's context is "
                                 f"{context}", "prompt")
        if max_tokens is not None and max_tokens > room:
            raise InvalidRequest(f"{param}={max_tokens} does not fit: the prompt has "
                                 f"{prompt_len} tokens and the context is {context}", param)
        cache = self.max_request_tokens
        if max_tokens is None:  # as many as fit: the context, and the cache when known
            max_tokens = room if cache is None else max(1, min(room, cache - prompt_len))
        if cache is not None and prompt_len + max_tokens > cache:
            raise InvalidRequest(f"{prompt_len} prompt tokens + {param}={max_tokens} do not fit "
                                 f"a decoder's KV cache of {cache} tokens", param)
        temperature = 1.0 if body.temperature is None else body.temperature
        return Sampling(max_tokens, temperature,
                        1.0 if body.top_p is None else body.top_p, max(body.top_k, 0), body.seed,
                        body.ignore_eos)


def _text_length(content: str | list[dict[str, Any]] | None) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content or [] if isinstance(part, dict))


def build_app(door: FrontDoor, http: HTTPConfig | None = None) -> FastAPI:
    """The API over `door`; `http` gives its body limit and API key (the rest of `HTTPConfig`
    is the HTTP server's: `http_server.py`)."""
    http = http or HTTPConfig()
    max_body_bytes = http.max_body_bytes
    app = FastAPI(title="disagg", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, *UTILITY_REQUESTS])
    install_api_key(app, http.api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers())

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        body = APIError(str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code)

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        timings = Timings()
        raw = await read_body(request, max_body_bytes)
        body = await door.off_loop(parse_body, raw, CompletionRequest)
        check_model(door, body.model)
        stops = body.stop_strings()
        prompt = await door.off_loop(door.prompt_ids, body.single_prompt())
        sampling = door.sampling(body, len(prompt), body.max_tokens, "max_tokens")
        return await serve(door, request, body, prompt, stops, sampling, timings, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        timings = Timings()
        raw = await read_body(request, max_body_bytes)
        body = await door.off_loop(parse_body, raw, ChatCompletionRequest)
        check_model(door, body.model)
        stops = body.stop_strings()
        prompt = await door.off_loop(door.chat_ids, body)
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        sampling = door.sampling(body, len(prompt), body.token_budget(), param)
        return await serve(door, request, body, prompt, stops, sampling, timings, chat=True)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(responses.model_list(door.model_name, door.created))

    @app.get("/health")
    async def health() -> JSONResponse:
        ok, body = await asyncio.to_thread(door.health)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = await asyncio.to_thread(generate_latest, door.metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    install_utility_routes(app, door, max_body_bytes)  # /tokenize, /detokenize, /version
    return app


def check_model(door: FrontDoor, model: str) -> None:
    if model != door.model_name:
        raise ModelNotFound(model)


async def serve(door: FrontDoor, request: Request, body: SamplingFields, prompt: list[int],
                stops: list[str], sampling: Sampling, timings: Timings, chat: bool) -> Response:
    """Submit, then stream or answer whole; every path records the request's metrics."""
    generation = Generation(door.client.open(prompt, sampling), door.tokenizer, stops, timings)
    envelope = responses.Envelope("chatcmpl" if chat else "cmpl", generation.stream.request_id,
                                  door.model_name)
    door.metrics.running.inc()
    if body.stream:
        return EventStream(stream_chunks(door, generation, envelope, len(prompt), chat,
                                         body.include_usage(), body.continuous_usage()))
    try:
        text, ids = await until_done_or_gone(request, collect(generation))
    except ClientGone:
        finish(door, generation, len(prompt), "abort")
        # Nobody reads this: nginx's "client closed request", for the access log only.
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as error:
        finish(door, generation, len(prompt), "abort" if isinstance(
            error, asyncio.CancelledError) else "error")
        raise
    finish(door, generation, len(prompt), generation.finish_reason or "error")
    reason = generation.finish_reason
    choice = (responses.chat_choice(text, reason, ids) if chat
              else responses.completion_choice(text, reason, ids))
    return JSONResponse(envelope.wrap("chat.completion" if chat else "text_completion",
                                      [choice], usage=responses.usage(
                                          len(prompt), generation.completion_tokens,
                                          generation.cached_tokens)))


CLIENT_CLOSED_REQUEST = 499


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def collect(generation: Generation) -> tuple[str, list[int]]:
    text, ids = "", []
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            text += delta.text
            ids += delta.token_ids
    return text, ids


async def until_done_or_gone(request: Request, work: Any) -> Any:  # noqa: ANN401
    """Run `work`; if the client disconnects first, cancel it (its cleanup aborts the request
    in the cluster) and raise `ClientGone`."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone
    return task.result()


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_chunks(door: FrontDoor, generation: Generation,
                        envelope: responses.Envelope, prompt_tokens: int, chat: bool,
                        include_usage: bool,
                        continuous_usage: bool = False) -> AsyncGenerator[bytes, None]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    extra: dict[str, Any] = {"usage": None} if include_usage else {}

    def running_usage() -> dict[str, Any]:  # vLLM's continuous_usage_stats: usage so far
        if include_usage and continuous_usage:
            return {"usage": responses.usage(prompt_tokens, generation.completion_tokens,
                                             generation.cached_tokens)}
        return extra

    reason = "abort"  # unless the loop below ends the request
    try:
        if chat:
            first = responses.chat_delta({"role": "assistant", "content": ""}, None)
            yield responses.sse(envelope.wrap(kind, [first], **running_usage()))
        # Closed here, not left to the garbage collector: its `finally` aborts the request.
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                yield responses.sse(envelope.wrap(kind, [_stream_choice(delta, chat)],
                                                  **running_usage()))
        reason = generation.finish_reason or "error"
        if include_usage:
            yield responses.sse(envelope.wrap(kind, [], usage=responses.usage(
                prompt_tokens, generation.completion_tokens, generation.cached_tokens)))
        yield responses.DONE
    except APIError as error:  # headers are sent: the error goes in the stream
        reason = "error"
        yield responses.sse(error.body())
        yield responses.DONE
    finally:  # also when a disconnect cancels the stream: the request was aborted by then
        finish(door, generation, prompt_tokens, reason)


def _stream_choice(delta: Delta, chat: bool) -> dict[str, Any]:
    if not chat:
        return responses.completion_choice(delta.text, delta.finish_reason, delta.token_ids)
    content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
    return responses.chat_delta(content, delta.finish_reason, delta.token_ids)


def finish(door: FrontDoor, generation: Generation, prompt_tokens: int, reason: str) -> None:
    door.metrics.running.dec()
    door.metrics.record(generation.timings, prompt_tokens, reason, generation.cached_tokens)
