"""GPU check, part 1: a captured graph bumping a mapped pinned counter, watched by the poller (S3b).

A stand-in forward (KV append, two GEMMs, bump, per layer) is captured once and replayed; the
`CounterPoller` must report every layer's bump, and a copy-engine read of the layer's KV issued
from the callback must already see that forward's data. Also: replay time with and without the
bump, and the time from `graph.replay()` to the poller's callback. Run by `gpu_check.py`.
"""

from __future__ import annotations

import statistics
import threading
import time

import torch
from gpu_check_common import SEED, Row

NUM_LAYERS = 32
HIDDEN = 2048
KV_WIDTH = 4096


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


def capture(forward: _Forward, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
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


def replay_ms(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, replays: int) -> float:
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


def graph_counter_check() -> list[Row]:
    from transfer_core.cuda.mapped_counter import MappedCounter
    from transfer_core.poller import CounterPoller

    replays = 200
    counter = MappedCounter()
    replay_stream, check_stream = torch.cuda.Stream(), torch.cuda.Stream()
    forward = _Forward(counter.device_tensor)
    graph = capture(forward, replay_stream)
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
    plain = replay_ms(capture(_Forward(None), replay_stream), replay_stream, replays)
    bumped = replay_ms(graph, replay_stream, replays)
    return [
        ("layer bumps observed", observed == expected, f"{observed}/{expected}",
         f"{len(jumps)} callbacks, largest jump {max(jumps)}"),
        ("KV visible at bump", not stale, f"{len(stale)} stale",
         what + (f", first stale (value, seen): {stale[:3]}" if stale else "")),
        ("replay without counter", True, f"{plain:.3f} ms", f"{NUM_LAYERS} layers, per forward"),
        ("replay with counter", True, f"{bumped:.3f} ms", f"+{(bumped - plain) * 1e3:.1f} us"),
    ]  # fmt: skip


def latency_check() -> list[Row]:
    from transfer_core.cuda.mapped_counter import MappedCounter
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


