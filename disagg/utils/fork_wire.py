"""The records a fork server and its clients exchange (X5f): one JSON object per
SOCK_SEQPACKET message, file descriptors passed beside it (SCM_RIGHTS). `fork_server.py`
lists the records.
"""

from __future__ import annotations

import json
import socket
from typing import Any

MAX_RECORD = 1 << 20


def send_record(sock: socket.socket, record: dict[str, Any], fds: list[int] = ()) -> None:
    """One JSON record, with `fds` passed beside it."""
    socket.send_fds(sock, [json.dumps(record).encode()], list(fds))


def recv_record(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    """The next record and the fds beside it; (None, []) once the peer has closed."""
    data, fds, _, _ = socket.recv_fds(sock, MAX_RECORD, max_fds)
    return (json.loads(data) if data else None), fds
