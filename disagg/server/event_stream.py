"""A server-sent-events response whose chunks one task produces, and which stops cleanly when
the client goes (X5b).

Starlette's `StreamingResponse` iterates the chunks in one task while another listens for the
disconnect, and closing the generator from the listener can race the iteration ("aclose():
asynchronous generator is already running"). Here the producer task alone touches the
generator: the listener only cancels that task, whose own `finally` blocks then abort the
request in the cluster, at once and without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStream(Response):
    """An ASGI response streaming `chunks`; a disconnect cancels their producer.

    A `Response` so that FastAPI passes it through; none of `Response`'s body handling
    applies (no content length, no background task)."""

    def __init__(self, chunks: AsyncGenerator[bytes, None]) -> None:  # noqa: D107
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.raw_headers = list(HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        producer = asyncio.ensure_future(self._produce(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({producer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Cancelled here too when the server stops: the producer must not outlive us.
            gone.cancel()
            producer.cancel()
            await asyncio.gather(producer, gone, return_exceptions=True)
        if not producer.cancelled() and producer.exception() is not None:
            raise producer.exception()  # type: ignore[misc] - a bug, not a disconnect

    async def _produce(self, send: Send) -> None:
        async with contextlib.aclosing(self.chunks) as chunks:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
