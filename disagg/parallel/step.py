"""One step's model inputs as the leader sends them and a rank receives them (S3c).

A step goes to each rank over the Unix socket that brought the leader its KV memory: one
pickled frame (the leader and its ranks are one program, started by it, so pickle is safe).
Over gloo it would cost two collectives per step (a size, then the bytes), each a round trip
through every rank; a socket write is a few microseconds. `None` tells a rank to stop, and a
`PageCopy` to copy a page in its own KV shard (a fork's tail page, `engine/forking.py`): on
the same socket, so the copy runs between the steps it was sent between.
"""

from __future__ import annotations

import pickle
import socket
import struct
from dataclasses import replace
from typing import NamedTuple

import torch

from disagg.model.attention import AttentionMetadata, SequenceSlice

Step = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]
_LENGTH = struct.Struct("!Q")


class PageCopy(NamedTuple):
    """Copy page `src` into page `dst` of the rank's KV shard, every layer, K and V."""

    src: int
    dst: int


def encode_step(step: Step | PageCopy | None) -> bytes:
    """`step` (its tensors moved to host memory), a `PageCopy` or `None`, as one
    length-prefixed frame."""
    message = step if step is None or isinstance(step, PageCopy) else step_to(step, "cpu")
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


def receive_step(sock: socket.socket) -> Step | PageCopy | None:
    """The leader's next step or page copy, or `None` (stop, or the leader is gone)."""
    header = _read(sock, _LENGTH.size)
    if header is None:
        return None
    body = _read(sock, _LENGTH.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _read(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        part = sock.recv(min(n - got, 1 << 20))
        if not part:
            return None
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _to(tensor: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def step_to(step: Step, device: str | torch.device) -> Step:
    """`step` with every tensor on `device` (host memory to broadcast, a rank's device to run)."""
    input_ids, positions, meta = step
    sequences = [SequenceSlice(s.query_start, s.query_len, s.context_len, s.page_ids.to(device))
                 for s in meta.sequences]
    meta = replace(meta, slot_page_ids=meta.slot_page_ids.to(device),
                   slot_offsets=meta.slot_offsets.to(device), sequences=sequences,
                   decode_page_table=_to(meta.decode_page_table, device),
                   decode_kv_lens=_to(meta.decode_kv_lens, device))
    return input_ids.to(device), positions.to(device), meta
