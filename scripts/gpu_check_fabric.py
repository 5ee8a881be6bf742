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
from gpu_check_common import SEED, Row

# A 16-layer KV cache of 16-token pages x 8 heads x 128 dims, bf16: 64 KiB pages.
NUM_LAYERS, PAGE_SHAPE = 16, (2, 16, 8, 128)


def _kv(device: str, num_pages: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(SEED)
    shape = (NUM_LAYERS, num_pages, *PAGE_SHAPE)
    return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)


def transfer_check(device: str = "cuda", providers: tuple[str, ...] = ("tcp", "shm"),
                   num_pages: int = 512) -> list[Row]:
    """Half of `num_pages` pages of every layer, scattered to other page ids: the run of
    `benchmarks/staging.py`, on the path "auto" picks on CUDA (staged forced on CPU)."""
    from benchmarks.staging import one_run

    path = "auto" if device == "cuda" else "staged"
    rows: list[Row] = []
    for provider in providers:
        try:
            run = one_run(provider, device, path, NUM_LAYERS, num_pages, SEED)
        except Exception as exc:  # one provider's failure must not hide the other's result
            rows.append((f"GPU KV over {provider}", False, "error", f"{type(exc).__name__}: {exc}"))
            continue
        rows += [
            (f"GPU KV over {provider}", bool(run["exact"]), f"{run['gbps']:.2f} GB/s",
             f"{run['nbytes'] >> 20} MiB in 64 KiB pages, {run['path']} path, copying "
             f"{run['copy_share']:.0%} of the time; byte-exact, nothing else touched: "
             f"{run['exact']}"),
            (f"memory path ({provider})", True, str(run["path"]), str(run["reason"])),
        ]  # fmt: skip
    return rows


def posting_latency_check(device: str = "cuda", samples: int = 300, num_pages: int = 64
                          ) -> list[Row]:
    """Replay a one-bump graph; the poller's callback stages one page and posts its write,
    as `PrefillMessenger._on_counter` does per layer. Times from replay to posted."""
    from disagg.model.layer_counter import LayerCounter
    from transfer_core.engine import TransferEngine
    from transfer_core.poller import CounterPoller
    from transfer_core.staging import open_engine, register_kv
    from transfer_core.transport import PagedWrite

    counter = LayerCounter.for_device(device)
    bump = _one_bump(counter, device)
    arrived, posted, done = [0], [0], threading.Event()
    written = threading.Semaphore(0)

    def make(hmem: bool) -> TransferEngine:
        return TransferEngine("tcp", hmem=hmem)

    with open_engine(make, device == "cuda") as a, TransferEngine("tcp") as b:
        path = "auto" if device == "cuda" else "staged"
        src = register_kv(a, _kv(device, num_pages), "lat-src", path)
        dst_buffer = bytearray(src.tensor[0, 0].numel() * src.tensor.element_size())
        _, dst = b.register_memory(dst_buffer, "lat-dst")

        def on_change(_: int, old: int, new: int) -> None:
            arrived[0] = time.perf_counter_ns()
            src.stage_out(0, [new % num_pages])
            n = len(dst_buffer)
            a.post_paged_writes(PagedWrite(src.region, [new % num_pages], n, 0, dst, [0], n, 0,
                                             n, None), on_done=written.release)
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
