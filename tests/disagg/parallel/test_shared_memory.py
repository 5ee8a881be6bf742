"""A rank's KV memory and the leader's mapping of it are the same bytes (S5a)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from disagg.errors import RankError
from disagg.parallel.shared_memory import create_region, map_region, recv_message, send_message

# A stand-in rank: allocates a region, sends its fd, then writes into it when told to.
RANK = textwrap.dedent("""
    import socket, sys, torch
    from disagg.parallel.shared_memory import create_region, send_message
    region = create_region(4096, "test-rank")
    tensor = region.tensor(torch.float32, (1024,))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    send_message(sock, {"rank": 1}, [region.fd])
    sock.recv(1)                  # the leader has mapped it: write
    tensor[:] = torch.arange(1024, dtype=torch.float32)
    sock.sendall(b"w")
    sock.recv(1)                  # the leader wrote 7s into the second half: read them back
    sock.sendall(b"y" if bool((tensor[512:] == 7).all()) else b"n")
""")


@pytest.mark.slow  # a second Python importing torch: about 1.5 s
def test_a_rank_writes_and_the_leader_reads_and_back(tmp_path: object) -> None:
    """Another process's memfd, mapped here: its writes are read here and ours there."""
    path = os.path.join(str(tmp_path), "s.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        rank = subprocess.Popen([sys.executable, "-c", RANK, path])
        try:
            conn, _ = server.accept()
            with conn:
                header, fds = recv_message(conn)
                assert header == {"rank": 1} and len(fds) == 1
                region = map_region(fds[0], 4096)
                mapped = region.tensor(torch.float32, (1024,))
                assert bool((mapped == 0).all())  # fresh memfd pages are zero
                conn.sendall(b"g")
                assert conn.recv(1) == b"w"
                assert torch.equal(mapped, torch.arange(1024, dtype=torch.float32))
                mapped[512:] = 7
                conn.sendall(b"r")
                assert conn.recv(1) == b"y"
                region.close()
        finally:
            assert rank.wait(10) == 0


def test_a_region_smaller_than_announced_is_refused() -> None:
    """A rank that says 8 KiB but shares 4 KiB gets a RankError, not a mapping past the end."""
    region = create_region(4096, "short")
    fd = os.dup(region.fd)
    with pytest.raises(RankError, match="4096 bytes, the rank said 8192"):
        map_region(fd, 8192)
    region.close()


def test_a_tensor_larger_than_the_region_is_refused() -> None:
    region = create_region(64, "small")
    with pytest.raises(RankError, match="needs 128 bytes"):
        region.tensor(torch.float32, (32,))
    region.close()


def test_a_message_without_header_is_refused() -> None:
    """A peer that closes before saying who it is: RankError."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        right.close()
        with pytest.raises(RankError, match="before saying who it is"):
            recv_message(left)


def test_messages_carry_their_fds() -> None:
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    region = create_region(128, "fds")
    with left, right:
        send_message(left, {"n": 1}, [region.fd])
        header, fds = recv_message(right)
    assert header == {"n": 1} and len(fds) == 1 and os.fstat(fds[0]).st_size == 128
    os.close(fds[0])
    region.close()

