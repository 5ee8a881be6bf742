"""One request through the cluster as the HTTP layer sees it: text deltas, stop strings, the
finish reason and the token counts, from the decoder's `RequestEvent`s.

Text comes from `StreamDecoder` (special tokens skipped). A stop string ends the request with
finish reason "stop": the text is cut before it, and leaving the event loop aborts the request
in the cluster. Text that could still turn out to be the start of a stop string is held back
until it cannot (`stop_strings.StopMatcher`, linear in the text: X5b).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from disagg.control.messages import RequestEvent
from disagg.engine.request import RequestState
from disagg.model.loading.tokenizer import StreamDecoder, Tokenizer
from disagg.server.cluster_client import RequestStream
from disagg.server.errors import APIError, InvalidRequest, Unavailable
from disagg.server.stop_strings import StopMatcher

FINISH_REASONS = {RequestState.FINISHED_STOPPED: "stop", RequestState.FINISHED_LENGTH: "length"}


class GenerationFailed(APIError):
    """The cluster could not finish the request (a failed transfer, a dead decoder)."""

    status = 500
    type = "server_error"


@dataclass(slots=True)
class Delta:
    """What one step of the stream adds: text, its token ids, and at the end a reason."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass(slots=True)
class Timings:
    """Wall-clock marks of one request, for the latency histograms."""

    arrival: float = field(default_factory=time.monotonic)
    first_event: float | None = None  # the decoder took it: the end of its queue time
    token_times: list[float] = field(default_factory=list)
    end: float | None = None


@dataclass(slots=True)
class Generation:
    """One submitted request: iterate `deltas()`; then read `completion_tokens` and
    `finish_reason`. Timings start when the request arrived (pass its `Timings`)."""

    stream: RequestStream
    tokenizer: Tokenizer | None
    stops: list[str]
    timings: Timings = field(default_factory=Timings)
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the decoder found in its prefix cache
    finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self.stream.close()  # a stop string, an error or a client gone: abort it there

    async def _deltas(self) -> AsyncIterator[Delta]:
        decoder = StreamDecoder(self.tokenizer, True) if self.tokenizer is not None else None
        matcher = StopMatcher(self.stops)
        async for event in self.stream.events():  # its own cleanup is `stream.close()`
            now = time.monotonic()
            self.timings.first_event = self.timings.first_event or now
            self.cached_tokens = max(self.cached_tokens, event.num_cached_tokens)
            self._check(event)
            text = ""
            for token in event.token_ids:
                self.completion_tokens += 1
                self.timings.token_times.append(now)
                text += decoder.push(token) if decoder is not None else ""
            if event.state.is_terminal() and decoder is not None:
                text += decoder.flush()
            text, stopped = matcher.feed(text)
            if stopped or event.state.is_terminal():
                self.finish_reason = "stop" if stopped else FINISH_REASONS[event.state]
                self.timings.end = now
                tail = "" if stopped else matcher.flush()
                yield Delta(text + tail, list(event.token_ids), self.finish_reason)
                return
            if text or event.token_ids:
                yield Delta(text, list(event.token_ids))

    def _check(self, event: RequestEvent) -> None:
        if event.state is RequestState.FINISHED_FAILED:
            cause = event.cause.value if event.cause else "unknown"
            error = {"no_prefiller": Unavailable, "invalid_request": InvalidRequest}.get(
                cause, GenerationFailed)
            raise error(f"the cluster could not finish the request ({cause}): {event.detail}",
                        code=cause)
        if event.state is RequestState.FINISHED_ABORTED:
            raise GenerationFailed(f"the request was aborted: {event.detail}", code="aborted")
