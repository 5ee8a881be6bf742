"""Whether a connection's other end belongs to a given local process (X5d).

A node listening without a cluster secret cannot tell its peers apart by what they send, so
it takes a `Shutdown` only from the process that started it: its parent. On Linux the kernel
says who holds the other end of a loopback connection: the peer's socket is the line of
`/proc/net/tcp` (or `tcp6`) whose local address is our peer address, and its inode is among
the parent's open descriptors. Reading them needs nothing but the same user, which a parent
is. Anything that cannot be read answers False: the Shutdown is refused, never guessed.
"""

from __future__ import annotations

import os
import socket
import struct


def peer_is_process(sock: socket.socket, pid: int) -> bool:
    """Whether the other end of connected `sock` is a socket process `pid` holds open."""
    try:
        if sock.family == socket.AF_UNIX:
            ucred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                    struct.calcsize("3i"))
            return struct.unpack("3i", ucred)[0] == pid
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        inode = _peer_inode(sock)
        return inode is not None and _holds(pid, f"socket:[{inode}]")
    except OSError:
        return False


def _peer_inode(sock: socket.socket) -> str | None:
    """The inode of the peer's socket: the table row seen from its side (local = our peer)."""
    table = "/proc/net/tcp6" if sock.family == socket.AF_INET6 else "/proc/net/tcp"
    theirs = _proc_address(sock.family, *sock.getpeername()[:2])
    ours = _proc_address(sock.family, *sock.getsockname()[:2])
    with open(table) as rows:
        next(rows)  # the header
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[1] == theirs and fields[2] == ours:
                return fields[9]
    return None


def _proc_address(family: int, host: str, port: int) -> str:
    """`host:port` as /proc/net/tcp writes it: the address in 32-bit words of host byte order,
    in hex, then the port."""
    packed = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def _holds(pid: int, link: str) -> bool:
    directory = f"/proc/{pid}/fd"
    for fd in os.listdir(directory):
        try:
            if os.readlink(os.path.join(directory, fd)) == link:
                return True
        except OSError:
            continue  # closed while we looked
    return False
