"""One request fails alone (X5a): what the engine does when stepping a request raises.

NOTE on what is isolated. The engine thread runs each request's share of a step (sampling,
stop checks, speculative verification and acceptance, draft choice) inside
`RequestIsolation.guard`: an exception there fails that request alone (`FINISHED_FAILED`, cause
`ENGINE_ERROR`, or `INVALID_REQUEST` for a `RequestError` such as a grammar that cannot go on;
the exception named in the detail, its pages freed) and the step goes on with
the others. What cannot be pinned on one request (the batched forward and the observers around
it, the draft model's batched runs) fails every request it ran for, and the engine goes on with
the rest. Two things still propagate, because they say the node itself is broken, not a
request: a dead TP rank (`RankError`), and a forward that fails `MAX_FORWARD_FAILURES` times in
a row (a poisoned device fails every batch); the node then fails and its requests go elsewhere
(X4d, X5e). A prefiller isolates nothing: RDMA writes already posted may still read its
requests' pages, which only its messenger may free, so there an exception propagates as before
and the decoders ask another prefiller (X4d). Failed requests wait in `take_failures` until the
node tells their clients.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from disagg.engine.request import FailureCause, Request
from disagg.errors import RequestError
from disagg.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)
MAX_FORWARD_FAILURES = 3  # consecutive failed forwards that mean the node, not a batch, is bad
MAX_DETAIL_CHARS = 300  # an exception's text can be huge (a tensor's repr): the client gets this


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """A request the engine failed, and why; `detail` names the exception."""

    request: Request
    cause: FailureCause
    detail: str


class RequestIsolation:
    """Fails requests whose step raised, and keeps them until the node reports them."""

    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._failures: list[EngineFailure] = []

    @contextmanager
    def guard(self, request: Request, what: str) -> Iterator[None]:
        """Run the body for `request` alone: if it raises, `request` fails (and only it), and
        the code after the `with` goes on (check `request.is_finished` there)."""
        try:
            yield
        except Exception as error:  # any one request's bug; never BaseException (^C, exit)
            self.fail([request], what, error)

    def fail(self, requests: Iterable[Request], what: str, error: Exception) -> None:
        """Fail every unfinished one of `requests` because `what` raised `error`; the error and
        its traceback go to the log, its type and text to each request's client."""
        failing = [request for request in requests if not request.is_finished]
        if not failing:
            return
        logger.error("%s raised for %s: failing %s, the engine goes on", what,
                     ", ".join(r.request_id for r in failing[:8]),
                     "it" if len(failing) == 1 else f"those {len(failing)}", exc_info=error)
        detail = f"{what} failed: {type(error).__name__}: {error}"[:MAX_DETAIL_CHARS]
        # The request's own input that cannot be served (a grammar no token can go on with) is
        # the client's to fix, a 400 at the front door; anything else is the engine's.
        cause = (FailureCause.INVALID_REQUEST if isinstance(error, RequestError)
                 else FailureCause.ENGINE_ERROR)
        for request in failing:
            self._scheduler.fail_request(request)
            self._failures.append(EngineFailure(request, cause, detail))

    def take_failures(self) -> list[EngineFailure]:
        """The requests failed since the last call, oldest first."""
        failures, self._failures = self._failures, []
        return failures
