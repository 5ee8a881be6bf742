"""Tests of `transfer_core.cuda.cumem`: cuMem KV memory shared between processes (S5a).

CPU tests: the module imports, fails with `CudaError` without a GPU, and the fd message is
validated. `gpu_only` tests: allocate, view, export and import, in one and in two processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from transfer_core.cuda import cumem
from transfer_core.cuda.driver import cuda_available
from transfer_core.errors import CudaError

HAS_GPU = torch.cuda.is_available() and cuda_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cuda-python")
needs_no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without CUDA")
SEED = 1234


def _fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@needs_no_gpu
@pytest.mark.parametrize("call", [lambda: cumem.allocate(1 << 20), cumem.granularity])
def test_without_gpu_raises_cuda_error(call: Callable[[], object]) -> None:
    """Allocation and queries name the missing driver or device."""
    with pytest.raises(CudaError, match="CUDA_ERROR_"):
        call()


@needs_no_gpu
def test_import_without_gpu_raises_and_closes_the_fd() -> None:
    """A received fd is closed even when the import cannot happen."""
    fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(CudaError, match="CUDA_ERROR_"):
        cumem.import_fd(fd, 1 << 21)
    assert not _fd_is_open(fd)


def test_recv_rejects_a_message_without_magic() -> None:
    """A foreign message on the socket is refused and its fd closed."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = os.open(os.devnull, os.O_RDONLY)
    with left, right:
        socket.send_fds(left, [b"XXXX" + bytes(16)], [fd])
        os.close(fd)
        with pytest.raises(ValueError, match="magic"):
            cumem.recv_allocation(right)


def test_recv_rejects_a_message_without_fd() -> None:
    """A header alone is not an allocation."""
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with left, right:
        left.sendall(b"KVM1" + bytes(16))
        with pytest.raises(ValueError, match="0 fds"):
            cumem.recv_allocation(right)


@pytest.mark.gpu_only
@needs_gpu
def test_allocation_is_rounded_up_and_viewable() -> None:
    """The size is a multiple of the granularity; a typed view reads back what it wrote."""
    allocation = cumem.allocate(3 << 20)
    assert allocation.size % cumem.granularity() == 0
    assert allocation.size >= 3 << 20
    view = allocation.as_tensor(torch.bfloat16, (4, 1024))
    view.fill_(1.5)
    assert float(view.float().sum()) == 1.5 * 4 * 1024
    with pytest.raises(ValueError, match="does not fit"):
        allocation.as_tensor(torch.float32, (allocation.size,))
    del view
    allocation.close()
    assert allocation.closed


@pytest.mark.gpu_only
@needs_gpu
def test_export_then_import_in_one_process_aliases_memory() -> None:
    """An imported mapping sees writes made through the original one."""
    allocation = cumem.allocate(1 << 21)
    imported = cumem.import_fd(allocation.export_fd(), allocation.size, allocation.device)
    allocation.as_tensor(torch.int64).copy_(torch.arange(allocation.size // 8, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(imported.as_tensor(torch.int64).cpu(), torch.arange(allocation.size // 8))
    imported.close()
    allocation.close()


def _rank_process(path: str) -> None:
    """A TP rank: allocate, fill with seeded data, send; then check what the main process wrote."""
    generator = torch.Generator().manual_seed(SEED)
    allocation = cumem.allocate(4 << 20)
    data = allocation.as_tensor(torch.int32)
    data.copy_(torch.randint(0, 1 << 30, data.shape, generator=generator, dtype=torch.int32))
    torch.cuda.synchronize()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        cumem.send_allocation(sock, allocation)
        assert sock.recv(4) == b"done"
        expected = torch.arange(data.numel(), dtype=torch.int32)
        sock.sendall(b"ok" if torch.equal(data.cpu(), expected) else b"no")


@pytest.mark.gpu_only
@pytest.mark.slow
@needs_gpu
def test_two_processes_share_kv_memory(tmp_path: Path) -> None:
    """Data written by a rank is read by the main process, and back, through one fd."""
    path = str(tmp_path / "kv.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(path)
        server.listen(1)
        rank = mp.get_context("spawn").Process(target=_rank_process, args=(path,))
        rank.start()
        conn, _ = server.accept()
        with conn:
            imported = cumem.recv_allocation(conn)
            data = imported.as_tensor(torch.int32)
            generator = torch.Generator().manual_seed(SEED)
            expected = torch.randint(0, 1 << 30, data.shape, generator=generator, dtype=torch.int32)
            assert torch.equal(data.cpu(), expected)
            data.copy_(torch.arange(data.numel(), dtype=torch.int32, device="cuda"))
            torch.cuda.synchronize()
            conn.sendall(b"done")
            assert conn.recv(2) == b"ok"
    rank.join(60)
    assert rank.exitcode == 0
    del data
    imported.close()
