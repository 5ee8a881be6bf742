"""One request through the cluster as the HTTP layer sees it: text deltas, stop strings, the
finish reason, log probabilities and the token counts, from the decoder's `RequestEvent`s.

A request asks for `n` choices (parallel samples forked on the decoder, S8); each has its own
text, stop matching and finish reason, and the request ends when every choice has. Text comes
from `StreamDecoder` (special tokens skipped). A stop string ends its choice with finish reason
"stop": the text is cut before it, and the choice is aborted in the cluster (the whole request
once no choice is left). Text that could still turn out to be the start of a stop string is
held back until it cannot (`stop_strings.StopMatcher`, linear in the text: X5b).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from disagg.control.messages import RequestEvent
from disagg.engine.logprobs import TokenLogprob
from disagg.engine.request import RequestState
from disagg.errors import RequestError
from disagg.model.loading.tokenizer import StreamDecoder, Tokenizer
from disagg.node.wire_sampling import event_logprobs
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
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked
    index: int = 0  # which choice


@dataclass(slots=True)
class Timings:
    """Wall-clock marks of one request, for the latency histograms."""

    arrival: float = field(default_factory=time.monotonic)
    first_event: float | None = None  # the decoder took it: the end of its queue time
    token_times: list[float] = field(default_factory=list)
    end: float | None = None


@dataclass(slots=True)
class Choice:
    """One of a request's choices, as its events arrive."""

    decoder: StreamDecoder | None
    matcher: StopMatcher
    finish_reason: str | None = None
    decoded: int = 0  # characters decoded so far (some may be held back by the matcher)
    emitted: int = 0  # characters sent so far


@dataclass(slots=True)
class Generation:
    """One submitted request: iterate `deltas()`; then read `completion_tokens` and
    `finish_reasons`. Timings start when the request arrived (pass its `Timings`)."""

    stream: RequestStream
    tokenizer: Tokenizer | None
    stops: list[str]
    timings: Timings = field(default_factory=Timings)
    n: int = 1
    completion_tokens: int = 0  # over every choice
    cached_tokens: int = 0  # prompt tokens the decoder found in its prefix cache
    finish_reasons: list[str | None] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        """The first choice's (the only one unless `n > 1`)."""
        return self.finish_reasons[0] if self.finish_reasons else None

    async def deltas(self) -> AsyncIterator[Delta]:
        try:
            async with contextlib.aclosing(self._deltas()) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            self.stream.close()  # a stop string, an error or a client gone: abort it there

    async def _deltas(self) -> AsyncIterator[Delta]:
        choices = [Choice(StreamDecoder(self.tokenizer, True) if self.tokenizer else None,
                          StopMatcher(self.stops)) for _ in range(self.n)]
        self.finish_reasons = [None] * self.n
        async for event in self.stream.events():  # its own cleanup is `stream.close()`
            now = time.monotonic()
            self.timings.first_event = self.timings.first_event or now
            self.cached_tokens = max(self.cached_tokens, event.num_cached_tokens)
            if not 0 <= event.index < self.n:
                raise GenerationFailed(f"the decoder sent choice {event.index} of {self.n}")
            choice = choices[event.index]
            # A choice that met a stop string: this is its abort, or tokens before it. A
            # failure is the request's, whichever choice it names.
            if choice.finish_reason is not None and (
                    event.state is not RequestState.FINISHED_FAILED):
                continue
            self._check(event)
            delta = self._step(choice, event, now)
            if delta is not None:
                yield delta
            if all(c.finish_reason is not None for c in choices):
                self.timings.end = now
                return
        # The events ended (the cluster ended the request) with a choice still open.
        raise GenerationFailed(f"the cluster ended the request with choices "
                               f"{[i for i, c in enumerate(choices) if c.finish_reason is None]} "
                               "unfinished")

    def _step(self, choice: Choice, event: RequestEvent, now: float) -> Delta | None:
        """What one event adds to its choice, if anything."""
        try:
            logprobs = event_logprobs(event.token_ids, event.logprobs, event.top_logprob_ids,
                                      event.top_logprobs)
        except RequestError as error:
            raise GenerationFailed(str(error)) from None
        text, ends = "", []  # where each token's text ends in the choice's text
        for token in event.token_ids:
            self.completion_tokens += 1
            self.timings.token_times.append(now)
            text += choice.decoder.push(token) if choice.decoder is not None else ""
            ends.append(choice.decoded + len(text))
        if event.state.is_terminal() and choice.decoder is not None:
            text += choice.decoder.flush()
        choice.decoded += len(text)
        text, stopped = choice.matcher.feed(text)
        choice.emitted += len(text)
        if stopped and logprobs:  # a token that reaches into the stop string is not the answer
            logprobs = [lp for lp, end in zip(logprobs, ends, strict=True)
                        if end <= choice.emitted]
        if stopped or event.state.is_terminal():
            choice.finish_reason = "stop" if stopped else FINISH_REASONS[event.state]
            self.finish_reasons[event.index] = choice.finish_reason
            if stopped and self.n > 1 and not event.state.is_terminal():
                self.stream.abort_choice(event.index)  # the others go on
            tail = "" if stopped else choice.matcher.flush()
            return Delta(text + tail, list(event.token_ids), choice.finish_reason, logprobs,
                         event.index)
        if text or event.token_ids:
            return Delta(text, list(event.token_ids), None, logprobs, event.index)
        return None

    def _check(self, event: RequestEvent) -> None:
        if event.state is RequestState.FINISHED_FAILED:
            cause = event.cause.value if event.cause else "unknown"
            error = {"no_prefiller": Unavailable, "invalid_request": InvalidRequest}.get(
                cause, GenerationFailed)
            raise error(f"the cluster could not finish the request ({cause}): {event.detail}",
                        code=cause)
        if event.state is RequestState.FINISHED_ABORTED:
            raise GenerationFailed(f"the request was aborted: {event.detail}", code="aborted")
