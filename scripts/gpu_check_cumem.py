"""GPU check, part 3: cuMem KV memory allocated by a "rank" process and imported here (S5a).

A spawned rank allocates cuMem, fills it from a seeded generator and sends it by fd over a Unix
socket; this process imports it, checks the bytes, writes new ones, and the rank checks those.
Import and copy timings go in the table. Run by `gpu_check.py`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time

import torch
from gpu_check_common import SEED, Row

CUMEM_BYTES = 256 << 20


def _rank_process(path: str) -> None:
    """A TP rank: allocate cuMem KV, fill it from a seeded CUDA generator, send it; verify."""
    from transfer_core.cuda import cumem

    started = time.perf_counter()
    allocation = cumem.allocate(CUMEM_BYTES)
    alloc_ms = (time.perf_counter() - started) * 1e3
    data = allocation.as_tensor(torch.int32)
    generator = torch.Generator(device="cuda").manual_seed(SEED)
    data.random_(0, 1 << 30, generator=generator)
    torch.cuda.synchronize()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(path)
        cumem.send_allocation(sock, allocation)
        if sock.recv(4) != b"done":
            raise RuntimeError("main process did not finish")
        ok = torch.equal(data, torch.arange(data.numel(), dtype=torch.int32, device="cuda"))
        sock.sendall(f"{'ok' if ok else 'no'} {alloc_ms:.2f} {int(allocation.rdma)}".encode())


def cumem_check() -> list[Row]:
    from transfer_core.cuda import cumem

    with tempfile.TemporaryDirectory() as tmp, socket.socket(socket.AF_UNIX) as server:
        path = os.path.join(tmp, "kv.sock")
        server.bind(path)
        server.listen(1)
        rank = mp.get_context("spawn").Process(target=_rank_process, args=(path,))
        rank.start()
        server.settimeout(120)
        conn, _ = server.accept()
        with conn:
            started = time.perf_counter()
            imported = cumem.recv_allocation(conn)
            import_ms = (time.perf_counter() - started) * 1e3
            data = imported.as_tensor(torch.int32)
            expected = torch.empty_like(data)
            expected.random_(0, 1 << 30, generator=torch.Generator(device="cuda").manual_seed(SEED))
            forward_ok = torch.equal(data, expected)
            source = torch.arange(data.numel(), dtype=torch.int32, device="cuda")
            gbps = _copy_gbps(data, source)
            conn.sendall(b"done")
            conn.settimeout(120)
            verdict, alloc_ms, rdma = conn.recv(64).decode().split()
        rank.join(120)
    del data, expected, source
    imported.close()
    return [
        ("cuMem rank -> main", forward_ok, f"{CUMEM_BYTES >> 20} MiB", "seeded data byte-exact"),
        ("cuMem main -> rank", verdict == "ok" and rank.exitcode == 0, verdict,
         f"rank exit code {rank.exitcode}"),
        ("cuMem allocate (rank)", True, f"{float(alloc_ms):.2f} ms", f"rdma capable: {rdma}"),
        ("cuMem import + map", True, f"{import_ms:.2f} ms", "recv fd, import, map, set access"),
        ("copy into imported", True, f"{gbps:.1f} GB/s", "device-to-device through the import"),
    ]  # fmt: skip


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, repeats: int = 10) -> float:
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return dst.numel() * dst.element_size() * repeats / (start.elapsed_time(end) * 1e6)


