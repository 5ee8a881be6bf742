"""A decoder's spans of the requests it serves (X7a), in the trace their router started.

A request's span opens at admission, as a child of the `traceparent` its `Submit` carried,
and its own context goes to the prefiller in the `KVRequest`, so the prefiller's spans hang
under it. Beneath it: `admission` (until a prefiller was asked), `kv_wait` (until the KV
counter fired, S2c), `first_token_sent` and `decode` (from the first token to the end). It ends
when the request's last choice has (`RouterReports`), with the state it ended in; a fork's
spans are its parent's (forks inherit the context, `forking.py`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from disagg.engine.request import Request, RequestState
from disagg.utils.trace import Tracer


@dataclass(slots=True)
class _Marks:
    admitted_at: float
    first_token_at: float = 0.0


class RequestSpans:
    """Opens, annotates and ends each request's span on one decoder."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer
        self._marks: dict[str, _Marks] = {}  # by request id, while the request lives

    def admitted(self, request: Request, parent: str) -> None:
        """`request` was taken: its span opens (a disabled tracer hands `parent` on)."""
        request.traceparent = self._tracer.open(
            request.request_id, "request", parent=parent, request_id=request.request_id,
            prompt_tokens=request.num_prompt_tokens, n=request.sampling_params.n)
        if self._tracer.enabled:
            self._marks[request.request_id] = _Marks(time.time())

    def kv_arrived(self, request: Request, wait_s: float) -> None:
        """Its KV landed after `wait_s` from asking a prefiller."""
        marks = self._marks.get(request.request_id)
        if marks is None:
            return
        now = time.time()
        asked = max(marks.admitted_at, now - wait_s)
        ids = {"parent": request.traceparent, "request_id": request.request_id}
        self._tracer.complete("admission", marks.admitted_at, asked, **ids)
        self._tracer.complete("kv_wait", asked, now, attempt=request.kv_attempts, **ids)

    def token(self, request: Request) -> None:
        """A token of `request` (or of one of its choices) was reported."""
        request_id = request.parent_id or request.request_id
        marks = self._marks.get(request_id)
        if marks is not None and not marks.first_token_at:
            marks.first_token_at = time.time()
            # Not "first_token": a merged Perfetto view reads that milestone from the
            # router's events (`figures`); this is when the decoder sent it.
            self._tracer.instant("first_token_sent", at_s=marks.first_token_at,
                                 parent=request.traceparent, request_id=request_id)

    def ended(self, request: Request, state: RequestState) -> None:
        """Its last choice ended in `state`: `decode` is recorded and its span ends."""
        request_id = request.parent_id or request.request_id
        marks = self._marks.pop(request_id, None)
        if marks is not None and marks.first_token_at:
            self._tracer.complete("decode", marks.first_token_at, time.time(),
                                  parent=request.traceparent, request_id=request_id)
        self._tracer.end(request_id, state=state.value,
                         failed=state is RequestState.FINISHED_FAILED)

    def refused(self, request_id: str, detail: str) -> None:
        """Admission failed after the span opened: it ends as refused."""
        self._marks.pop(request_id, None)
        self._tracer.end(request_id, state=RequestState.FINISHED_FAILED.value, detail=detail,
                         failed=True)
