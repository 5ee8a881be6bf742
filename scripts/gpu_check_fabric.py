"""GPU check, part 4: KV pages from GPU memory through the fabric, on the path chosen (S5, S3b).

Two transfer engines in this process (loopback) register a GPU KV cache each through
`transfer_core.staging` (FI_HMEM where the provider has it, else pinned host staging, chosen
automatically and reported), write every layer of a set of pages, and compare the bytes on
the GPU. Then the latency from a graph's counter bump to the layer's write being posted, with
the poller staging and posting from its callback as the prefill messenger does. On CPU
(`dry_run`) the same code forces the staged path over CPU tensors. Run by `gpu_check.py`.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from gpu_check_common import SEED, Row, synchronize

# A 16-layer KV cache of 16-token pages x 8 heads x 128 dims, bf16: 64 KiB pages.
NUM_LAYERS, PAGE_SHAPE = 16, (2, 16, 8, 128)
IMM = 11


def _kv(device: str, fill: bool, num_pages: int) -> torch.Tensor:
    shape = (NUM_LAYERS, num_pages, *PAGE_SHAPE)
    if not fill:
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    generator = torch.Generator(device=device).manual_seed(SEED)
    return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)


def transfer_check(device: str = "cuda", providers: tuple[str, ...] = ("tcp", "shm"),
                   num_pages: int = 512) -> list[Row]:
    """Half of `num_pages` pages of every layer, scattered to other page ids."""
    rows: list[Row] = []
    for provider in providers:
        try:
            rows += _transfer(device, provider, num_pages)
        except Exception as exc:  # one provider's failure must not hide the other's result
            rows.append((f"GPU KV over {provider}", False, "error", f"{type(exc).__name__}: {exc}"))
    return rows


def _transfer(device: str, provider: str, num_pages: int) -> list[Row]:
    from transfer_core.engine import TransferEngine
    from transfer_core.staging import register_kv

    path = "auto" if device == "cuda" else "staged"
    generator = torch.Generator().manual_seed(SEED)
    pages_sent = num_pages // 2
    src_pages = torch.randperm(num_pages, generator=generator)[:pages_sent].tolist()
    dst_pages = torch.randperm(num_pages, generator=generator)[:pages_sent].tolist()
    hmem = device == "cuda"
    with _engine(TransferEngine, provider, hmem) as a, _engine(TransferEngine, provider, hmem) as b:
        src = register_kv(a, _kv(device, True, num_pages), "gpu-src", path)
        dst = register_kv(b, _kv(device, False, num_pages), "gpu-dst", path)
        page_nbytes = src.tensor[0, 0].numel() * src.tensor.element_size()
        layer_nbytes = num_pages * page_nbytes
        reached = threading.Event()
        b.expect_imm_count(IMM, NUM_LAYERS * pages_sent, reached.set)
        synchronize(device)
        started = time.perf_counter()
        staging_s = 0.0
        for layer in range(NUM_LAYERS):
            staged_at = time.perf_counter()
            src.stage_out(layer, src_pages)
            staging_s += time.perf_counter() - staged_at
            a.submit_paged_writes(page_nbytes, src.region, src_pages, page_nbytes,
                                  layer * layer_nbytes, dst.descriptor, dst_pages, page_nbytes,
                                  layer * layer_nbytes, IMM)
        if not reached.wait(120):
            raise TimeoutError(f"{b.imm_counted(IMM)} of {NUM_LAYERS * pages_sent} writes landed")
        staged_at = time.perf_counter()
        dst.stage_in(dst_pages)
        staging_s += time.perf_counter() - staged_at
        seconds = time.perf_counter() - started
        exact = torch.equal(dst.tensor[:, dst_pages], src.tensor[:, src_pages])
        untouched = sorted(set(range(num_pages)) - set(dst_pages))
        clean = not dst.tensor[:, untouched].any().item()
        nbytes = NUM_LAYERS * pages_sent * page_nbytes
        paths = f"src {src.path.kind}, dst {dst.path.kind}"
        src.close(a)
        dst.close(b)
    return [
        (f"GPU KV over {provider}", exact and clean, f"{nbytes / seconds / 1e9:.2f} GB/s",
         f"{NUM_LAYERS * pages_sent} x {page_nbytes >> 10} KiB pages, {paths}, "
         f"staging {staging_s / seconds:.0%} of the time; byte-exact {exact}, "
         f"others clean {clean}"),
        (f"memory path ({provider})", True, src.path.kind, src.path.reason),
    ]  # fmt: skip


def _engine(engine_class: type, provider: str, hmem: bool) -> object:
    """An engine asking for FI_HMEM where it may help, falling back as the nodes do."""
    if hmem:
        try:
            return engine_class(provider, hmem=True)
        except Exception:  # noqa: BLE001 - no FI_HMEM provider here: staging it is
            pass
    return engine_class(provider)


def posting_latency_check(device: str = "cuda", samples: int = 300, num_pages: int = 64
                          ) -> list[Row]:
    """Replay a one-bump graph; the poller's callback stages one page and posts its write,
    as `PrefillMessenger._on_counter` does per layer. Times from replay to posted."""
    from disagg.layer_counter import LayerCounter
    from transfer_core.engine import TransferEngine
    from transfer_core.poller import CounterPoller
    from transfer_core.staging import register_kv

    counter = LayerCounter.for_device(device)
    bump = _one_bump(counter, device)
    arrived, posted, done = [0], [0], threading.Event()
    written = threading.Semaphore(0)
    with _engine(TransferEngine, "tcp", device == "cuda") as a, TransferEngine("tcp") as b:
        path = "auto" if device == "cuda" else "staged"
        src = register_kv(a, _kv(device, True, num_pages), "lat-src", path)
        dst_buffer = bytearray(src.tensor[0, 0].numel() * src.tensor.element_size())
        _, dst = b.register_memory(dst_buffer, "lat-dst")

        def on_change(_: int, old: int, new: int) -> None:
            arrived[0] = time.perf_counter_ns()
            src.stage_out(0, [new % num_pages])
            a.submit_paged_writes(len(dst_buffer), src.region, [new % num_pages], len(dst_buffer),
                                  0, dst, [0], len(dst_buffer), 0, None, on_done=written.release)
            posted[0] = time.perf_counter_ns()
            done.set()

        to_callback, to_posted = [], []
        with CounterPoller([counter.poll_target], on_change):
            for _ in range(samples):
                done.clear()
                started = time.perf_counter_ns()
                bump()
                if not done.wait(5.0):
                    raise TimeoutError("the poller missed a bump")
                to_callback.append((arrived[0] - started) / 1e3)
                to_posted.append((posted[0] - started) / 1e3)
        for _ in range(samples):  # every write completed before the engines close
            if not written.acquire(timeout=30):
                raise TimeoutError("a posted write never completed")
        src.close(a)
    return [("bump -> write posted", True, f"p50 {statistics.median(to_posted):.1f} us",
             f"p99 {_p99(to_posted):.1f} us; to callback p50 "
             f"{statistics.median(to_callback):.1f} us; {samples} samples, {src.path.kind} path")]


def _one_bump(counter: object, device: str) -> object:
    """A callable bumping the counter once: a captured one-kernel graph on CUDA."""
    if device != "cuda":
        return counter.bump
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        counter.value.add_(1)  # warm-up: load the kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        counter.value.add_(1)
    torch.cuda.synchronize()

    def replay() -> None:
        with torch.cuda.stream(stream):
            graph.replay()

    return replay


def _p99(values: list[float]) -> float:
    return sorted(values)[max(0, int(len(values) * 0.99) - 1)]
