"""KV memory a rank allocates and its node's leader maps: one buffer, two processes (S5a).

A TP rank's KV cache must be registered with the one transfer engine of its node, which lives
in the leader. So each rank allocates its cache as memory another process can map, and sends
the leader a file descriptor for it over a Unix socket (SCM_RIGHTS). On CPU that is a memfd
mapped MAP_SHARED on both sides (by torch, whose storage unmaps it with its last tensor); on CUDA it is a cuMem allocation exported as a POSIX fd
(`transfer_core.cuda.cumem`), imported on the same physical GPU. Either way the leader's tensor
and the rank's tensor are the same bytes: a write landing in one is read by the other.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

from disagg.errors import RankError

_LENGTH = struct.Struct("!I")
_MAX_HEADER = 1 << 16


@dataclass
class HostRegion:
    """A memfd of `nbytes` bytes: each `tensor` maps it shared in this process."""

    fd: int
    nbytes: int

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The region as a tensor sharing its memory. The tensor's storage owns its mapping
        (unmapped with the last view) and keeps no fd, so closing the region leaks nothing."""
        need = dtype.itemsize * math.prod(shape)
        if need > self.nbytes:
            raise RankError(f"a {dtype} tensor of shape {shape} needs {need} bytes, the shared "
                            f"region has {self.nbytes}")
        flat = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=need,
                               dtype=torch.uint8)
        return flat.view(dtype).view(shape)

    def close(self) -> None:
        """Close the fd; the memory lives until the last mapping (and tensor) is gone."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create_region(nbytes: int, name: str) -> HostRegion:
    """A new zero-filled shared region (memfd; the kernel zeroes new pages)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return HostRegion(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def map_region(fd: int, nbytes: int) -> HostRegion:
    """Map a region another process created; this process then owns `fd`."""
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise RankError(f"shared KV region is {size} bytes, the rank said {nbytes}")
        return HostRegion(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def send_message(sock: socket.socket, header: dict[str, Any], fds: list[int] = ()) -> None:
    """One JSON header (length-prefixed), with `fds` attached as SCM_RIGHTS."""
    body = json.dumps(header).encode()
    socket.send_fds(sock, [_LENGTH.pack(len(body)) + body], list(fds))


def recv_message(sock: socket.socket, max_fds: int = 1) -> tuple[dict[str, Any], list[int]]:
    """The next `send_message`: its header and the fds that came with it (now ours)."""
    data, fds, _, _ = socket.recv_fds(sock, _LENGTH.size + _MAX_HEADER, max_fds)
    try:
        if len(data) < _LENGTH.size:
            raise RankError("rank closed its socket before saying who it is")
        (length,) = _LENGTH.unpack_from(data)
        body = data[_LENGTH.size:]
        if length != len(body):
            raise RankError(f"rank message of {len(body)} bytes, its header says {length}")
        header = json.loads(body)
        if not isinstance(header, dict):
            raise RankError(f"rank message is not a JSON object: {body[:80]!r}")
        return header, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
