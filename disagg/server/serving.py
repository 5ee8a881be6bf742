"""One request's answer: submitted to the cluster, then streamed as server-sent events or
returned whole, with its metrics recorded on every path (S2a, X5b).

A client that disconnects cancels its request's task; the request is then aborted in the
cluster and counted with finish reason "abort". An error after the stream's headers went out
is sent in the stream, as OpenAI's API does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from disagg.engine.request import SamplingParams
from disagg.model.loading.tokenizer import Tokenizer
from disagg.server import responses
from disagg.server.choices import Shape, StreamedChoice, WholeChoice
from disagg.server.cluster_client import ClusterClient
from disagg.server.errors import APIError
from disagg.server.event_stream import EventStream
from disagg.server.generation import Generation, Timings
from disagg.server.metrics import ServerMetrics
from disagg.server.protocol import SamplingFields

CLIENT_CLOSED_REQUEST = 499


class Door(Protocol):
    """What answering needs of the front door (`app.FrontDoor`)."""

    model_name: str
    tokenizer: Tokenizer | None
    client: ClusterClient
    metrics: ServerMetrics


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


async def serve(door: Door, request: Request, body: SamplingFields, prompt: list[int],
                stops: list[str], params: SamplingParams, timings: Timings,
                shape: Shape) -> Response:
    """Submit, then stream or answer whole; every path records the request's metrics."""
    generation = Generation(door.client.open(prompt, params), door.tokenizer, stops, timings,
                            params.n)
    envelope = responses.Envelope("chatcmpl" if shape.chat else "cmpl",
                                  generation.stream.request_id, door.model_name)
    door.metrics.running.inc()
    if body.stream:
        return EventStream(stream_chunks(door, generation, envelope, len(prompt), shape,
                                         body.include_usage(), body.continuous_usage()))
    try:
        choices = await until_done_or_gone(request, collect(generation, shape))
    except ClientGone:
        finish(door, generation, len(prompt), "abort")
        # Nobody reads this: nginx's "client closed request", for the access log only.
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except BaseException as error:
        finish(door, generation, len(prompt), "abort" if isinstance(
            error, asyncio.CancelledError) else "error")
        raise
    finish(door, generation, len(prompt), generation.finish_reason or "error")
    return JSONResponse(envelope.wrap(
        "chat.completion" if shape.chat else "text_completion",
        [choice.render() for choice in choices], usage=responses.usage(
            len(prompt), generation.completion_tokens, generation.cached_tokens)))


async def collect(generation: Generation, shape: Shape) -> list[WholeChoice]:
    choices = [WholeChoice(shape, index) for index in range(generation.n)]
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            choices[delta.index].add(delta)
    return choices


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


async def stream_chunks(door: Door, generation: Generation, envelope: responses.Envelope,
                        prompt_tokens: int, shape: Shape, include_usage: bool,
                        continuous_usage: bool = False) -> AsyncGenerator[bytes, None]:
    kind = "chat.completion.chunk" if shape.chat else "text_completion"
    extra: dict[str, Any] = {"usage": None} if include_usage else {}

    def running_usage() -> dict[str, Any]:  # vLLM's continuous_usage_stats: usage so far
        if include_usage and continuous_usage:
            return {"usage": responses.usage(prompt_tokens, generation.completion_tokens,
                                             generation.cached_tokens)}
        return extra

    choices = [StreamedChoice(shape, index) for index in range(generation.n)]
    reason = "abort"  # unless the loop below ends the request
    try:
        if shape.chat:
            for choice in choices:
                yield responses.sse(envelope.wrap(kind, [choice.first()], **running_usage()))
        # Closed here, not left to the garbage collector: its `finally` aborts the request.
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                for chunk in choices[delta.index].chunks(delta):
                    yield responses.sse(envelope.wrap(kind, [chunk], **running_usage()))
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


def finish(door: Door, generation: Generation, prompt_tokens: int, reason: str) -> None:
    door.metrics.running.dec()
    door.metrics.record(generation.timings, prompt_tokens, reason, generation.cached_tokens)
