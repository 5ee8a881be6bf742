"""Peer liveness on the control plane: heartbeats out, silence in (S2, X4d).

Every node sends a Heartbeat on each of its control connections every `HEARTBEAT_INTERVAL_S`
from a thread of its own, so a long forward step never looks like a dead node; a peer whose
channel has received nothing for `PEER_TIMEOUT_S` is declared gone (`is_silent`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from disagg.control.channel import Channel
from disagg.control.messages import Heartbeat
from disagg.errors import PeerClosedError

HEARTBEAT_INTERVAL_S = 1.0
PEER_TIMEOUT_S = 10.0  # a peer silent this long is declared dead


def is_silent(channel: Channel) -> bool:
    """Whether `channel` has received nothing for over `PEER_TIMEOUT_S`: its peer is gone."""
    return time.monotonic() - channel.last_received > PEER_TIMEOUT_S


def start_heartbeats(channels: Callable[[], list[Channel]], stop: threading.Event,
                     interval_s: float = HEARTBEAT_INTERVAL_S) -> threading.Thread:
    """A thread that sends a Heartbeat on every channel each `interval_s` until `stop`.

    Its own thread, not the engine loop: a long forward step must not look like a dead node.
    """
    def beat() -> None:
        while not stop.wait(interval_s):
            for channel in channels():
                with contextlib.suppress(PeerClosedError):  # its reader thread reports the loss
                    channel.send(Heartbeat())

    thread = threading.Thread(target=beat, daemon=True, name="heartbeats")
    thread.start()
    return thread
