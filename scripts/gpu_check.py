"""Exercise every GPU path of `transfer_core` on this machine and print a summary (S3b, S5a).

1. A mapped pinned counter bumped by a captured CUDA graph after each layer, watched by the
   `CounterPoller`: every layer's bump must be reported, and a copy-engine read of the
   layer's KV issued from the callback must already see that forward's data.
2. Graph replay time per forward with and without the counter bump, and the time from
   `graph.replay()` to the poller's callback for a one-bump graph.
3. cuMem KV memory allocated in a spawned "rank" process, passed by fd over a Unix socket,
   imported here, checked both ways, with import and copy timings.
Runs in well under five minutes. Without a GPU it says so and exits 0. Usage:
`python scripts/gpu_check.py`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

SEED = 1234
NUM_LAYERS = 32
HIDDEN = 2048
KV_WIDTH = 4096
CUMEM_BYTES = 256 << 20
Row = tuple[str, bool, str, str]


def main() -> int:
    console = Console()
    if not torch.cuda.is_available():
        console.print("gpu_check: no CUDA GPU on this machine (torch sees none); nothing to check.")
        return 0
    _ensure_poller_built()
    from transfer_core.cuda_host import cuda_available

    if not cuda_available():
        console.print("gpu_check: torch sees a GPU but cuda-python cannot reach it; skipping.")
        return 0
    rows: list[Row] = [*_environment()]
    for check in (_graph_counter_check, _latency_check, _cumem_check):
        started = time.perf_counter()
        try:
            rows.extend(check())
        except Exception as exc:  # reported in the table and in the exit code
            rows.append((check.__name__.strip("_"), False, "error", f"{type(exc).__name__}: {exc}"))
        console.log(f"{check.__name__} took {time.perf_counter() - started:.1f} s")
    table = Table(title="transfer_core GPU check")
    for column in ("check", "ok", "value", "detail"):
        table.add_column(column)
    for name, ok, value, detail in rows:
        table.add_row(name, "[green]yes" if ok else "[red]NO", value, detail)
    console.print(table)
    return 0 if all(ok for _, ok, _, _ in rows) else 1


def _ensure_poller_built() -> None:
    try:
        import transfer_core._poller  # noqa: F401
    except ImportError:
        from transfer_core._poller_build import ffibuilder

        ffibuilder.compile(tmpdir=str(ROOT))


def _environment() -> list[Row]:
    from transfer_core.cuda_host import check_cu, device_attribute, load_driver
    from transfer_core.topology import detect_topology

    version = check_cu("cuDriverGetVersion", load_driver().cuDriverGetVersion())
    maps = device_attribute(0, "CAN_MAP_HOST_MEMORY")
    vmm_rdma = device_attribute(0, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED")
    topology = detect_topology()
    group = topology.groups[0] if topology.groups else None
    near = f"NICs {[n.name for n in group.nics]}, {len(group.cpus)} CPUs" if group else "no GPU"
    return [
        ("device", True, torch.cuda.get_device_name(0), f"torch {torch.__version__}"),
        ("driver", True, f"{version // 1000}.{version % 1000 // 10}", "cuDriverGetVersion"),
        ("can map host memory", maps == 1, str(maps), "needed by MappedCounter"),
        ("GPUDirect RDMA with VMM", True, str(vmm_rdma), "cuMem rdma flag used if 1"),
        ("topology of GPU 0", group is not None, f"NUMA {group.numa_node if group else '-'}", near),
    ]


class _Forward:
    """A stand-in decoder forward: per layer a KV append (filled with the forward index),
    two GEMMs for attention and the output projection, then the counter bump."""

    def __init__(self, counter: torch.Tensor | None) -> None:
        generator = torch.Generator(device="cuda").manual_seed(SEED)
        self.x = torch.randn(64, HIDDEN, device="cuda", generator=generator)
        self.w = torch.randn(HIDDEN, HIDDEN, device="cuda", generator=generator) / HIDDEN**0.5
        self.kv = torch.zeros(NUM_LAYERS, KV_WIDTH, device="cuda")
        self.step = torch.zeros((), device="cuda")
        self.counter = counter

    def __call__(self) -> None:
        self.step.add_(1)
        h = self.x
        for layer in range(NUM_LAYERS):
            self.kv[layer].fill_(self.step)  # KV append of this layer
            h = torch.tanh(h @ self.w)  # attention
            h = h @ self.w  # output projection
            if self.counter is not None:
                self.counter.add_(1)


def _capture(forward: _Forward, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()  # warm-up outside capture, as torch requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        for _ in range(10):
            graph.replay()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def _graph_counter_check() -> list[Row]:
    from transfer_core.cuda_host import MappedCounter
    from transfer_core.poller import CounterPoller

    replays = 200
    counter = MappedCounter()
    replay_stream, check_stream = torch.cuda.Stream(), torch.cuda.Stream()
    forward = _Forward(counter.device_tensor)
    graph = _capture(forward, replay_stream)
    base, first_forward = counter.value, int(forward.step.item()) + 1
    probe = torch.zeros(1, pin_memory=True)
    stale: list[tuple[int, float]] = []
    jumps: list[int] = []

    def on_change(_: int, old: int, new: int) -> None:
        # Read each reported layer's KV with the copy engine, as a NIC would read it.
        jumps.append(new - old)
        for value in range(old + 1, new + 1):
            done = value - base
            layer, forward_index = (done - 1) % NUM_LAYERS, first_forward + (done - 1) // NUM_LAYERS
            with torch.cuda.stream(check_stream):
                probe.copy_(forward.kv[layer, :1], non_blocking=True)
            check_stream.synchronize()
            if probe.item() < forward_index:
                stale.append((value, probe.item()))

    expected = NUM_LAYERS * replays
    with CounterPoller([counter], on_change) as poller:
        with torch.cuda.stream(replay_stream):
            for _ in range(replays):
                graph.replay()
        poller.wait_for(0, base + expected, timeout=60)
    observed = sum(jumps)
    what = "copy-engine read of the layer's KV from the callback"
    plain = _replay_ms(_capture(_Forward(None), replay_stream), replay_stream, replays)
    bumped = _replay_ms(graph, replay_stream, replays)
    return [
        ("layer bumps observed", observed == expected, f"{observed}/{expected}",
         f"{len(jumps)} callbacks, largest jump {max(jumps)}"),
        ("KV visible at bump", not stale, f"{len(stale)} stale",
         what + (f", first stale (value, seen): {stale[:3]}" if stale else "")),
        ("replay without counter", True, f"{plain:.3f} ms", f"{NUM_LAYERS} layers, per forward"),
        ("replay with counter", True, f"{bumped:.3f} ms", f"+{(bumped - plain) * 1e3:.1f} us"),
    ]  # fmt: skip


def _latency_check() -> list[Row]:
    from transfer_core.cuda_host import MappedCounter
    from transfer_core.poller import CounterPoller

    counter = MappedCounter()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        counter.device_tensor.add_(1)  # warm-up: load the kernel before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        counter.device_tensor.add_(1)
    torch.cuda.synchronize()
    seen, arrived = threading.Event(), [0]

    def on_change(_: int, old: int, new: int) -> None:
        arrived[0] = time.perf_counter_ns()
        seen.set()

    samples = []
    with CounterPoller([counter], on_change):
        for _ in range(300):
            seen.clear()
            started = time.perf_counter_ns()
            with torch.cuda.stream(stream):
                graph.replay()
            if not seen.wait(5.0):
                raise TimeoutError("poller missed a bump")
            samples.append((arrived[0] - started) / 1e3)
    samples.sort()
    p50, p99 = statistics.median(samples), samples[int(len(samples) * 0.99) - 1]
    return [("replay -> callback", True, f"p50 {p50:.1f} us", f"p99 {p99:.1f} us, 300 samples")]


def _rank_process(path: str) -> None:
    """A TP rank: allocate cuMem KV, fill it from a seeded CUDA generator, send it; verify."""
    from transfer_core import cumem

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


def _cumem_check() -> list[Row]:
    from transfer_core import cumem

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


if __name__ == "__main__":
    sys.exit(main())
