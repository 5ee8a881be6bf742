"""A prefiller node: accepts decoders, prefills their requests, streams KV back (S2b, S3, S4b).

Threads: one accepts control connections; one per decoder reads its messages into the inbox
as typed records (`DecoderJoined`, `FromDecoder`, `DecoderGone`); the engine thread (this
object's `run`) drains the inbox, dispatching on those types, steps the engine, and lets the
messenger free finished requests. Bad input from a decoder (a malformed message, a request
with pages outside its region) is answered on that connection and never stops the node.
Built, with its engine and messenger, by `builder.build_node`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from disagg.control.channel import Channel
from disagg.control.liveness import (
    HEARTBEAT_INTERVAL_S,
    PEER_TIMEOUT_S,
    is_silent,
    start_heartbeats,
)
from disagg.control.messages import Heartbeat, Reject, Shutdown
from disagg.engine.llm_engine import LLMEngine
from disagg.engine.request import FailureCause
from disagg.errors import PeerClosedError, ProtocolError, RequestError
from disagg.kv_transfer.decoder_peer import DecoderPeer
from disagg.kv_transfer.handshake import expected_hello, hello_mismatches
from disagg.kv_transfer.messages import Cancel, Hello, HelloAck, HelloProof, KVFailed, KVRequest
from disagg.kv_transfer.prefill_messenger import PrefillMessenger
from disagg.node.base import Inbox, NodeBase, Wake
from disagg.node.node_ids import NodeIdClaims
from disagg.node.node_metrics import prefill_metrics
from disagg.utils.trace import Tracer
from transfer_core.errors import TransferError
from transfer_core.transport import Transport

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DecoderJoined:
    """A decoder's handshake succeeded."""

    peer: DecoderPeer


@dataclass(frozen=True, slots=True)
class FromDecoder:
    """A message a decoder sent after its handshake."""

    peer: DecoderPeer
    message: KVRequest | Cancel | Shutdown


@dataclass(frozen=True, slots=True)
class DecoderGone:
    """A decoder's connection broke or it broke the protocol."""

    peer: DecoderPeer
    reason: str


@dataclass(frozen=True, slots=True)
class ShutdownAsked:
    """An operator (or the demo) connected only to ask this node to stop."""


class PrefillNode(NodeBase):
    """One prefiller serving any number of decoders."""

    def __init__(self, engine: LLMEngine, messenger: PrefillMessenger, transfer: Transport,
                 inbox: Inbox, fingerprint: str, listen_address: str = "127.0.0.1:0",
                 node_id: str = "prefill-0", tracer: Tracer | None = None) -> None:
        self.engine = engine
        self.messenger = messenger
        self.transfer = transfer
        self.inbox = inbox
        self.node_id = node_id
        self.fingerprint = fingerprint
        self.tracer = tracer or Tracer()
        self.metrics = prefill_metrics(engine, messenger, transfer)
        self._listen(listen_address)
        self._stop = threading.Event()
        self.shutdown_requested = False
        self._channels: list[Channel] = []
        self._peers: list[DecoderPeer] = []
        self._node_ids = NodeIdClaims()  # one live decoder per node id (X5d)
        start_heartbeats(lambda: [peer.channel for peer in list(self._peers)], self._stop,
                         HEARTBEAT_INTERVAL_S)
        self._start_accepting(self._serve_decoder, "decoder")

    def _serve_decoder(self, channel: Channel) -> None:
        """Reader thread of one decoder: handshake, then forward its messages to the inbox."""
        try:
            hello = channel.recv()
            if isinstance(hello, Shutdown):  # an operator (or the demo) asking us to stop
                if refusal := self._shutdown_refusal(channel):
                    raise ProtocolError(refusal)
                self.inbox.put(ShutdownAsked())
                channel.close()
                return
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected Hello first, got {type(hello).__name__}")
            mismatches = hello_mismatches(hello, expected_hello(
                self.node_id, self.fingerprint, self.engine.model.config, self.engine.kv_cache))
            if mismatches:
                logger.warning("refusing decoder %s: %s", hello.node_id, "; ".join(mismatches))
                channel.send(Reject("peer mismatch: " + "; ".join(mismatches)))
                channel.close()
                return
            holder = self._node_ids.claim(hello.node_id, channel)
            if holder is not None:
                logger.warning("refusing decoder %s from %s: %s holds that id", hello.node_id,
                               channel.peer, holder.peer)
                channel.send(Reject(f"node id {hello.node_id!r} is held by a live decoder "
                                    f"({holder.peer}): give each decoder its own --node-id"))
                channel.close()
                return
            self._serve_claimed(channel, hello)
        except (ProtocolError, RequestError, TransferError) as error:
            self._refuse(channel, str(error))
        except PeerClosedError:
            channel.close()

    def _serve_claimed(self, channel: Channel, hello: Hello) -> None:
        """A decoder that holds its node id: the rest of the handshake, then its messages;
        the id is free again once the connection ends."""
        try:
            self._join(channel, hello)
        finally:
            self._node_ids.release(channel)

    def _join(self, channel: Channel, hello: Hello) -> None:
        try:
            peer = self.messenger.add_peer(hello, channel)  # writes its proof slot (S5)
            sharding = self.engine.kv_cache.sharding
            channel.send(HelloAck(self.node_id, self.transfer.address, sharding.tp,
                                  sharding.replicated))
            proof = channel.recv()  # nothing else is taken before it: it owns what it named
            if not isinstance(proof, HelloProof):
                raise ProtocolError(f"expected HelloProof after HelloAck, got "
                                    f"{type(proof).__name__}")
            self.messenger.accept_proof(peer, hello, proof)
            self.inbox.put(DecoderJoined(peer))
        except (ProtocolError, RequestError, TransferError) as error:
            self._refuse(channel, str(error))
            return
        except PeerClosedError:
            channel.close()
            return
        reason = "its reader thread failed"  # kept if an exception escapes (it propagates)
        try:
            reason = self._read_decoder(channel, peer)
        finally:
            self.inbox.put(DecoderGone(peer, reason))

    def _read_decoder(self, channel: Channel, peer: DecoderPeer) -> str:
        """Forward a joined decoder's messages to the inbox; returns why it ended."""
        while True:
            try:
                message = channel.recv()
            except ProtocolError as error:
                self._refuse(channel, str(error))
                return f"protocol error: {error}"
            except PeerClosedError as error:
                return str(error)
            if isinstance(message, Heartbeat):
                continue  # recv() already noted that the decoder is alive
            if isinstance(message, Shutdown) and (refusal := self._shutdown_refusal(channel)):
                logger.warning("%s: %s", channel.peer, refusal)
                try:
                    channel.send(Reject(refusal))
                except PeerClosedError as error:
                    return str(error)
            elif isinstance(message, KVRequest | Cancel | Shutdown):
                self.inbox.put(FromDecoder(peer, message))
            else:
                self._refuse(channel, f"unexpected {type(message).__name__} from a decoder")
                return "protocol error"

    def _refuse(self, channel: Channel, reason: str) -> None:
        """Tell the peer why and close. Whatever node id the connection holds is freed before
        the peer hears the reason, so that it may come straight back under that id (once told,
        it may reconnect before this thread would otherwise reach the release)."""
        self._node_ids.release(channel)
        logger.warning("closing connection to %s: %s", channel.peer, reason)
        try:
            channel.send(Reject(reason))
        except PeerClosedError:
            pass  # it is gone already; nothing else to tell it
        channel.close()

    def run(self) -> None:
        """The engine loop, until `stop()` or a Shutdown message."""
        while not self._stop.is_set():
            # Block (briefly: leases and heartbeats) unless the engine has work; finished
            # transfers and messages ring the inbox.
            self.inbox.drain(self._handle, block=not self.engine.has_unfinished())
            if self.engine.has_unfinished():
                self._traced_step()
            self.messenger.poll()
            self.messenger.expire_leases()
            self._keep_alive()

    def _keep_alive(self) -> None:
        """A decoder silent for too long is treated as dead (heartbeats go from their own
        thread, `start_heartbeats`)."""
        for peer in list(self._peers):
            if is_silent(peer.channel):
                self._peers.remove(peer)
                peer.channel.close()
                self.messenger.fail_peer(peer, f"decoder gone: silent for {PEER_TIMEOUT_S:g} s")

    def _handle(self, item: object) -> None:
        match item:
            case Wake():
                pass  # a transfer ended: `run` polls the messenger next
            case DecoderJoined(peer):
                self._peers.append(peer)
            case DecoderGone(peer, reason):
                logger.info("decoder %s left: %s", peer.peer_id, reason)
                if peer in self._peers:
                    self._peers.remove(peer)
                self.messenger.fail_peer(peer, f"decoder gone: {reason}")
            case FromDecoder(peer, KVRequest() as message):
                try:
                    self.messenger.start_request(message, peer)
                except RequestError as error:
                    logger.warning("refusing request %s from %s: %s", message.request_id,
                                   peer.peer_id, error)
                    self._tell(peer, KVFailed(message.request_id,
                                              FailureCause.PREFILLER_REFUSED, str(error)))
            case FromDecoder(peer, Cancel(request_id)):
                self.messenger.cancel(peer, request_id)
            case FromDecoder(_, Shutdown()) | ShutdownAsked():
                self.shutdown_requested = True
                self._stop.set()
            case _:
                raise TypeError(f"prefill node: no handler for {item!r}")

    def _tell(self, peer: DecoderPeer, message: KVFailed) -> None:
        try:
            peer.channel.send(message)
        except PeerClosedError:
            logger.info("decoder %s is gone", peer.peer_id)

    def wind_down(self, timeout_s: float = 5.0) -> None:
        """After a Shutdown: end what is still in flight (a decoder may have asked for KV just
        before it, or left without our noticing yet) as failed, and poll until its writes are
        done, so that `check_clean` checks the teardown, not the timing of the Shutdown."""
        self.messenger.fail_all("prefiller shutting down")

        def step_leftovers() -> None:  # their failed chunks end in a step
            if self.engine.has_unfinished():
                self._traced_step()

        poll_until_idle(self.messenger, timeout_s, step_leftovers)

    def settle(self, timeout_s: float = 5.0) -> None:
        """After `stop()`: poll until the writes still in flight complete on their own,
        failing nothing, so that `check_clean` looks at leaks, not at the stop's timing (a
        decoder can decode its last tokens before this side has reaped the completions of
        the writes that brought them: tcp reports a write done after it lands)."""
        poll_until_idle(self.messenger, timeout_s)

    def check_clean(self) -> None:
        """Assert nothing is left behind: no request, transfer, page or armed counter."""
        assert not self.engine.scheduler.has_unfinished(), "requests still scheduled"
        assert not self.messenger.has_work(), "transfers still in flight"
        assert not self.tracer.num_open, "request spans still open"
        self.engine.allocator.check_invariants(expect_all_free=True)


def poll_until_idle(messenger: PrefillMessenger, timeout_s: float,
                    step: Callable[[], None] | None = None) -> None:
    """Poll `messenger` (and call `step` after each poll) until nothing is in flight or
    `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while messenger.has_work() and time.monotonic() < deadline:
        messenger.poll()
        if step is not None:
            step()
        time.sleep(0.01)
