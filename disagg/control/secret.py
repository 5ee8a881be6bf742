"""The cluster secret and the per-connection keys it yields (S2: an authenticated control plane).

Every node of one cluster shares a secret (the environment variable `SECRET_ENV`, set by the
launcher for every process it starts). A connection's two keys are derived from it and both
sides' fresh nonces, one per direction, so a frame replayed on another connection or reflected
back to its sender fails its tag (`channel.py` checks them).
"""

from __future__ import annotations

import hashlib
import hmac
import os

SECRET_ENV = "DISAGG_CLUSTER_SECRET"
TAG_SIZE = 32  # HMAC-SHA256


def cluster_secret() -> bytes | None:
    """The shared cluster secret from the environment, if any."""
    value = os.environ.get(SECRET_ENV)
    return value.encode() if value else None


def derive_keys(secret: bytes, accepted: bool, own: bytes, peer: bytes) -> tuple[bytes, bytes]:
    """(send key, receive key) of one connection: the direction is in the key, so a frame
    reflected back to its sender fails too."""
    acceptor, connector = (own, peer) if accepted else (peer, own)
    to_connector, to_acceptor = (
        hmac.new(secret, b"disagg channel " + direction + acceptor + connector,
                 hashlib.sha256).digest() for direction in (b"a>c", b"c>a"))
    return (to_connector, to_acceptor) if accepted else (to_acceptor, to_connector)


def frame_tag(key: bytes, sequence: int, frame: bytes) -> bytes:
    return hmac.new(key, sequence.to_bytes(8, "big") + frame, hashlib.sha256).digest()
