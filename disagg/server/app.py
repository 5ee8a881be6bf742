"""The OpenAI-compatible HTTP API of a cluster: completions, chat completions, models, health
and metrics (FastAPI).

Handlers validate the body (`protocol.py`), turn the prompt into token ids, submit through
the `ClusterClient` and either stream server-sent events or answer once the request ends. A
client that disconnects cancels its handler; the request is then aborted in the cluster and
counted with finish reason "abort".
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from disagg.config import ModelConfig
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server import responses
from disagg.server.chat_template import ChatTemplate, require_chat_template
from disagg.server.cluster_client import ClusterClient, Sampling
from disagg.server.errors import APIError, InvalidRequest, ModelNotFound
from disagg.server.generation import Generation, Timings
from disagg.server.metrics import ServerMetrics
from disagg.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    parse_body,
)


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

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest(f"model {self.model_name!r} has no tokenizer: send the "
                                     "prompt as a list of token ids", "prompt")
            return self.tokenizer.encode(prompt)
        bad = [t for t in prompt if not 0 <= t < self.model.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary of "
                                 f"{self.model.vocab_size}", "prompt")
        return prompt

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


def build_app(door: FrontDoor) -> FastAPI:
    app = FastAPI(title="disagg", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        body = APIError(str(error.detail)).body()
        return JSONResponse(body, status_code=error.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        timings = Timings()
        body = parse_body(await request.body(), CompletionRequest)
        check_model(door, body.model)
        prompt = door.prompt_ids(body.single_prompt())
        sampling = door.sampling(body, len(prompt), body.max_tokens, "max_tokens")
        return await serve(door, request, body, prompt, sampling, timings, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        timings = Timings()
        body = parse_body(await request.body(), ChatCompletionRequest)
        check_model(door, body.model)
        template = require_chat_template(door.model_name, door.chat_template)
        assert door.tokenizer is not None  # a template comes with its tokenizer
        text = template.render([m.model_dump(exclude_none=True)
                                          for m in body.messages], body.add_generation_prompt)
        prompt = template.encode(text, door.tokenizer)
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        sampling = door.sampling(body, len(prompt), body.token_budget(), param)
        return await serve(door, request, body, prompt, sampling, timings, chat=True)

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

    return app


def check_model(door: FrontDoor, model: str) -> None:
    if model != door.model_name:
        raise ModelNotFound(model)


async def serve(door: FrontDoor, request: Request, body: SamplingFields, prompt: list[int],
                sampling: Sampling, timings: Timings, chat: bool) -> Response:
    """Submit, then stream or answer whole; every path records the request's metrics."""
    stops = body.stop_strings()
    generation = Generation(door.client.open(prompt, sampling), door.tokenizer, stops, timings)
    envelope = responses.Envelope("chatcmpl" if chat else "cmpl", generation.stream.request_id,
                                  door.model_name)
    door.metrics.running.inc()
    if body.stream:
        chunks = stream_chunks(door, generation, envelope, len(prompt), chat,
                               body.include_usage(), request, body.continuous_usage())
        return StreamingResponse(chunks, media_type="text/event-stream")
    try:
        text, ids = await until_done_or_gone(request, collect(generation))
    except BaseException as error:
        finish(door, generation, len(prompt), "abort" if isinstance(
            error, asyncio.CancelledError | ClientGone) else "error")
        raise
    finish(door, generation, len(prompt), generation.finish_reason or "error")
    reason = generation.finish_reason
    choice = (responses.chat_choice(text, reason, ids) if chat
              else responses.completion_choice(text, reason, ids))
    return JSONResponse(envelope.wrap("chat.completion" if chat else "text_completion",
                                      [choice], usage=responses.usage(
                                          len(prompt), generation.completion_tokens,
                                          generation.cached_tokens)))


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def collect(generation: Generation) -> tuple[str, list[int]]:
    text, ids = "", []
    async for delta in generation.deltas():
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


async def while_connected(request: Request, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`items`, until the client disconnects: then stop them (their cleanup aborts the
    request in the cluster). Writing to a closed connection need not fail, so we listen."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        while True:
            step = asyncio.ensure_future(anext(items))
            await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise ClientGone
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        gone.cancel()
        await items.aclose()  # type: ignore[attr-defined]


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def stream_chunks(door: FrontDoor, generation: Generation,
                        envelope: responses.Envelope, prompt_tokens: int, chat: bool,
                        include_usage: bool, request: Request,
                        continuous_usage: bool = False) -> AsyncIterator[bytes]:
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
        async for delta in while_connected(request, generation.deltas()):
            if chat:
                content = {"content": delta.text} if delta.text or not delta.finish_reason else {}
                choice = responses.chat_delta(content, delta.finish_reason, delta.token_ids)
            else:
                choice = responses.completion_choice(delta.text, delta.finish_reason,
                                                     delta.token_ids)
            yield responses.sse(envelope.wrap(kind, [choice], **running_usage()))
        reason = generation.finish_reason or "error"
        if include_usage:
            yield responses.sse(envelope.wrap(kind, [], usage=responses.usage(
                prompt_tokens, generation.completion_tokens, generation.cached_tokens)))
        yield responses.DONE
    except APIError as error:  # headers are sent: the error goes in the stream
        reason = "error"
        yield responses.sse(error.body())
        yield responses.DONE
    except ClientGone:
        pass  # nobody to tell; the request was aborted in the cluster
    finally:
        finish(door, generation, prompt_tokens, reason)


def finish(door: FrontDoor, generation: Generation, prompt_tokens: int, reason: str) -> None:
    door.metrics.running.dec()
    door.metrics.record(generation.timings, prompt_tokens, reason, generation.cached_tokens)
