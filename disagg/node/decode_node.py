"""A decoder node: takes requests from routers, gets their KV from prefillers, decodes (S2a,
S2c, S4c). With no prefillers it is the single-node "mixed" engine of S1 (`serve mixed`): it
prefills locally, in chunks, batched with its decodes.

At start-up it connects to every prefiller and shakes hands (a mismatch stops it with the
prefiller's reason); those links, their readers and their reconnection are
`prefiller_link.PrefillerLinks`. Threads: one accepts router connections; one per connection
(router or prefiller) reads messages into the inbox as typed records (`FromRouter`,
`FromPrefiller`, `PrefillerGone`); the engine thread (`run`) drains the inbox, dispatching on
those types, releases requests whose KV arrived, steps the engine, and reports tokens and
`RequestState`s to the routers. Built, with its engine and messenger, by `builder.build_node`.

A request belongs to the router connection that submitted it (X5d, `request_owners.py`): only
that connection can abort it, the same id from another connection is refused to that
connection alone, and when a connection ends (the router left, or was cut off for not reading,
X5c) its requests are aborted: nothing decodes for nobody. What the routers hear, fork by fork
for a request of `n` choices (X6c), is `router_reports.py`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from disagg.control.channel import Channel
from disagg.control.liveness import HEARTBEAT_INTERVAL_S, start_heartbeats
from disagg.control.messages import (
    Abort,
    Reject,
    RequestEvent,
    Shutdown,
    Status,
    Submit,
)
from disagg.engine.forking import FORK_SEPARATOR
from disagg.engine.llm_engine import LLMEngine
from disagg.engine.request import FailureCause, Request, RequestState
from disagg.errors import InvalidMessage, PeerClosedError, ProtocolError, RequestError
from disagg.kv_transfer.decode_messenger import DecodeMessenger
from disagg.kv_transfer.pending_kv import Outcome
from disagg.node.base import Inbox, NodeBase, Wake
from disagg.node.decode_inbox import FromPrefiller, FromRouter, PrefillerGone, RouterGone
from disagg.node.node_metrics import decode_metrics
from disagg.node.prefiller_link import PrefillerBack, PrefillerLinks
from disagg.node.request_owners import Claim
from disagg.node.request_spans import RequestSpans
from disagg.node.router_reports import RouterReports
from disagg.node.wire_sampling import logprob_fields, sampling_params
from disagg.utils.trace import Tracer
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)
PROGRESS_INTERVAL_S = 0.05


class DecodeNode(NodeBase):
    """One decoder, fed by one or more prefillers."""

    def __init__(self, engine: LLMEngine, messenger: DecodeMessenger, transfer: Transport,
                 inbox: Inbox, prefillers: Sequence[str], listen_address: str = "127.0.0.1:0",
                 node_id: str = "decode-0", tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.messenger = messenger
        self.tracer = tracer or Tracer()
        self.transfer = transfer
        self.inbox = inbox
        self.node_id = node_id
        self.metrics = decode_metrics(engine, messenger, transfer)
        self._stop = threading.Event()
        self.shutdown_requested = False
        self._channels: list[Channel] = []
        self._reports = RouterReports(
            lambda request_id: self.messenger.received_writes(request_id)[0],
            self._ended)
        self._spans = RequestSpans(self.tracer)
        self._last_progress = 0.0
        self._prefillers = PrefillerLinks(list(prefillers), messenger, transfer.num_domains,
                                          inbox.put, self._stop, self._channels.append,
                                          self._forget)
        self._routers: list[Channel] = []  # they hear our Status and heartbeats
        self._status = Status(True)
        pool = self.messenger.pool
        start_heartbeats(lambda: pool.live_channels() + self._routers, self._stop,
                         HEARTBEAT_INTERVAL_S)
        self._listen(listen_address)
        self._start_accepting(self._read_router, "router")

    def _read_router(self, channel: Channel) -> None:
        """Reader thread of one router connection (`_start_accepting` closes it after); the
        router hears this node's `Status` first, and heartbeats from then on."""
        self._reports.send(channel, self._status)  # before it is on the heartbeat list: first
        self._routers.append(channel)
        reason = "its reader thread failed"  # kept if an exception escapes (it propagates)
        try:
            while True:
                try:
                    message = channel.recv()
                except InvalidMessage as error:  # the stream is intact: refuse that one only
                    self._refuse_message(channel, error)
                    continue
                except ProtocolError as error:
                    self._reports.send(channel, Reject(str(error)))
                    reason = f"protocol error: {error}"
                    return
                except PeerClosedError as error:
                    reason = str(error)
                    return
                if isinstance(message, Shutdown) and (refusal := self._shutdown_refusal(channel)):
                    logger.warning("%s: %s", channel.peer, refusal)
                    self._reports.send(channel, Reject(refusal))
                elif isinstance(message, Submit | Abort | Shutdown):
                    self.inbox.put(FromRouter(channel, message))
                else:
                    self._reports.send(channel, Reject(f"unexpected {type(message).__name__}"))
        finally:
            self._routers.remove(channel)
            self.inbox.put(RouterGone(channel, reason))

    def _refuse_message(self, channel: Channel, error: InvalidMessage) -> None:
        """A router's message we cannot take: fail its request (if it named a new one), else
        say why; the router's other requests go on."""
        request_id = error.request_id
        if request_id is not None and request_id not in self._reports.owners:
            self._refuse(channel, request_id, str(error))
        else:
            self._reports.send(channel, Reject(str(error)))

    def peer_view(self) -> dict[str, Any]:
        """Its prefillers, each alive or not (`PrefillerLinks.view`)."""
        return self._prefillers.view()

    def health_state(self) -> str:
        """"ok", or "no_prefiller" while this decoder has prefillers but none alive."""
        return "ok" if self._status.accepting else "no_prefiller"

    def _announce_status(self) -> None:
        """Tell every router when this decoder stops or starts taking requests."""
        alive = self.messenger.pool.accepting
        if alive == self._status.accepting:
            return
        self._status = Status(alive, "" if alive else "no live prefiller")
        logger.warning("%s new requests (%s)", "taking" if alive else "refusing",
                       self._status.reason or "a prefiller is back")
        for channel in list(self._routers):
            self._reports.send(channel, self._status)

    def run(self) -> None:
        """The engine loop, until `stop()` or a Shutdown message."""
        while not self._stop.is_set():
            # Block (briefly: deadlines and heartbeats) unless the engine has work; counters
            # firing and messages arriving ring the inbox.
            self.inbox.drain(self._handle, block=not self.engine.has_unfinished())
            for outcome in self.messenger.poll():
                self._report_outcome(outcome)
            if self.engine.has_unfinished():
                self._step()
            self._report_progress()
            self._prefillers.close_silent()
            self._announce_status()

    def _report_outcome(self, outcome: Outcome) -> None:
        request, state, cause = outcome.request, outcome.state, outcome.cause
        if state is RequestState.RUNNING:  # released to the engine (S2c)
            receipt = outcome.receipt
            assert receipt is not None
            self.metrics.observe("kv_transfer_seconds", receipt.wait_ms / 1e3)
            self.metrics.inc("kv_bytes_total", receipt.nbytes)
            self.metrics.inc("kv_writes_total", receipt.writes)
            self._spans.kv_arrived(request, receipt.wait_ms / 1e3)
            self._report(request, state, kv_writes=receipt.writes,
                         kv_bytes=receipt.nbytes, kv_wait_ms=receipt.wait_ms)
            return
        assert cause is not None, "a retried, failed or aborted request names its cause"
        if state is not RequestState.FINISHED_ABORTED:
            self.metrics.inc("failures_total", cause=cause.value)
        detail = f"retrying: {outcome.detail}" if state is RequestState.WAITING_FOR_KV else (
            outcome.detail)
        self._report(request, state, cause=cause, detail=detail)

    def _step(self) -> None:
        for event in self._traced_step():
            request = event.request
            # A speculative step yields several tokens; only the last may end the request.
            state = request.state if event.finished else RequestState.RUNNING
            self._spans.token(request)
            self._report(request, state, [event.token_id], **logprob_fields(event.logprob),
                         num_draft_tokens=request.num_draft_tokens,
                         num_accepted_tokens=request.num_accepted_tokens)
        for failure in self.engine.take_failures():  # stepping it raised: it failed alone (X5a)
            self.metrics.inc("failures_total", cause=failure.cause.value)
            self._report(failure.request, RequestState.FINISHED_FAILED, cause=failure.cause,
                         detail=failure.detail)

    def _handle(self, item: object) -> None:
        match item:
            case Wake():
                pass  # a counter fired: `run` polls the messenger next
            case FromRouter(channel, Submit() as message):
                self._admit(channel, message)
            case FromRouter(channel, Abort(request_id, choice)):
                if self._reports.owners.owns(channel, request_id):
                    self._abort(request_id, "aborted by the client", choice)
                else:  # another connection's request, or none: not this one's to end
                    self._reports.send(channel, Reject(
                        f"abort of {request_id!r}: no such request from this connection"))
            case RouterGone(channel, reason):
                self._abort_all_of(channel, reason)
            case FromRouter(_, Shutdown()):
                self.shutdown_requested = True
                self._stop.set()
            case FromPrefiller(message):
                self.messenger.on_kv_failed(message)
            case PrefillerGone(index, reason, channel):
                self._prefillers.gone(index, reason, channel)
            case PrefillerBack(index, channel, ack):
                self._prefillers.use(channel, ack, index)
            case _:
                raise TypeError(f"decode node: no handler for {item!r}")

    def _abort(self, request_id: str, detail: str, choice: int = -1) -> None:
        """Cancel the KV transfer, or stop decoding, whichever applies; `choice` >= 0 stops
        only that fork of a forked request (X6c)."""
        scheduler = self.engine.scheduler
        forks = scheduler.forks_of(request_id)
        if choice >= 0:
            if choice < len(forks) and not forks[choice].is_finished:
                scheduler.abort_request(forks[choice].request_id)
                self._report(forks[choice], RequestState.FINISHED_ABORTED,
                             cause=FailureCause.ABORTED, detail=detail)
            return  # not forked yet, or that choice already ended: nothing runs for it
        if self.messenger.abort(request_id):
            return  # reported once its pages are safe (poll -> outcome)
        live = [fork for fork in forks if not fork.is_finished]
        request = scheduler.abort_request(request_id)
        if request is None:
            return
        for ended in live if request.forks else [request]:
            self._report(ended, RequestState.FINISHED_ABORTED, cause=FailureCause.ABORTED,
                         detail=detail)

    def _abort_all_of(self, channel: Channel, reason: str) -> None:
        """A router connection ended: abort every request it submitted (X5d)."""
        mine = self._reports.owners.owned_by(channel)
        if mine:
            logger.warning("router %s left (%s): aborting its %d requests", channel.peer,
                           reason, len(mine))
        for request_id in mine:
            self._abort(request_id, f"its router left: {reason}")

    def _admit(self, channel: Channel, message: Submit) -> None:
        if FORK_SEPARATOR in message.request_id:  # forks are named <id>/<index> (X6c)
            self._refuse(channel, message.request_id,
                         f"request id {message.request_id!r} contains {FORK_SEPARATOR!r}")
            return
        claim = self._reports.owners.claim(message.request_id, channel)
        if claim is Claim.SAME_CONNECTION:
            # Refused by a Reject, not a RequestEvent: an event for that id would end the
            # request already in flight, as far as its router can tell.
            self._reports.send(channel, Reject(
                f"request {message.request_id!r} is already in flight on this decoder"))
            return
        if claim is Claim.OTHER_CONNECTION:  # only this connection hears of it (X5d)
            self._refuse(channel, message.request_id,
                         f"request id {message.request_id!r} is in flight from another "
                         "connection to this decoder: choose unique ids")
            return
        try:
            params = sampling_params(message)
            request = Request(message.request_id, list(message.prompt_token_ids), params,
                              self.engine.model.config.eos_token_ids)
            self._spans.admitted(request, message.traceparent)  # before a prefiller is asked
            self.engine.chooser.admit(request)  # its grammar starts compiling before KV moves
            self.messenger.admit(request)
        except RequestError as error:
            self._spans.refused(message.request_id, str(error))
            self._reports.owners.release(message.request_id)
            self._refuse(channel, message.request_id, str(error))
            return
        self._reports.opened(request.request_id, params.n)  # each ends with its own event
        if not request.is_finished:  # one that failed at once is reported with its cause
            self._report(request, request.state)

    def _refuse(self, channel: Channel, request_id: str, detail: str) -> None:
        """Fail a request this node will not take, telling only the connection that sent it."""
        self._reports.send(channel, RequestEvent(request_id, RequestState.FINISHED_FAILED,
                                                 cause=FailureCause.INVALID_REQUEST,
                                                 detail=detail))

    def _report(self, request: Request, state: RequestState, token_ids: list[int] | None = None,
                detail: str = "", **kv: Any) -> None:
        if self._reports.report(request, state, token_ids, detail, **kv):
            # One choice failed: the request has failed, so its other choices stop.
            self._abort(request.parent_id or request.request_id,
                        f"choice {request.index} of the request failed: {detail}")

    def _ended(self, request: Request, state: RequestState) -> None:
        """A request's last choice ended: count it, end its span."""
        self.metrics.inc("requests_total", state=state.value)
        self._spans.ended(request, state)

    def _report_progress(self) -> None:
        now = time.monotonic()
        if now - self._last_progress < PROGRESS_INTERVAL_S:
            return
        self._last_progress = now
        for pending in self.messenger.pending.values():
            self._report(pending.request, RequestState.WAITING_FOR_KV)

    def check_clean(self) -> None:
        """Assert nothing is left behind: no request, transfer context, page or counter."""
        assert not self.engine.scheduler.has_unfinished(), "requests still scheduled"
        assert self.messenger.idle(), "KV still awaited or pages still quarantined"
        assert not self.transfer.pending_imm_counts(), "immediate counters still armed"
        assert not self.tracer.num_open, "request spans still open"
        self.engine.allocator.check_invariants(expect_all_free=True)
