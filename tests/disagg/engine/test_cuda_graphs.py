"""The static-buffer decode path on CPU: same tokens as the eager engine, harmless padding (S3b).

On CPU `DecodeGraphs` runs the code a CUDA graph would capture, eagerly, over the same static
buffers, so every bucket, padding and refill rule is tested here; only capture and replay
themselves need a GPU (`test_graph_runner_cuda.py`). The reference is the default engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disagg.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.engine.batch import Batch, ForwardOutput
from disagg.engine.cuda_graphs import (
    DecodeGraphs,
    page_buckets,
    smallest_bucket,
    useful_batch_sizes,
)
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.engine.request import SamplingParams
from disagg.errors import ConfigError
from disagg.model.layer_counter import LayerCounter
from disagg.model.loading.registry import init_random_weights
from disagg.speculative.speculator import build_speculative_engine

CONFIG = ModelConfig.from_name("tiny")
WEIGHTS = init_random_weights(CONFIG, seed=3)
# (step at which the wave arrives, prompt lengths, max_tokens): batches of 1, 3, 5 and 9
# decodes, prefill chunks arriving in between, requests finishing at different steps so the
# batch shrinks inside and across buckets and stale rows stay behind in the static buffers.
WAVES = [(0, [5], [6]), (4, [2, 9, 4], [4, 12, 7]), (12, [3, 1, 6, 8, 2], [3, 9, 5, 14, 2]),
         (22, [13, 4, 7, 1, 10, 3, 6, 2, 5], [14, 17, 12, 16, 13, 18, 15, 12, 16])]


def make_engine(cuda_graph: bool, kv_layout: str = "NHD", page_size: int = 4, tp: int = 1,
                chunk_size: int = 4, graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                device: str = "cpu", spec: SpeculativeConfig | None = None) -> LLMEngine:
    config = EngineConfig(CONFIG, CacheConfig(page_size, 256 // page_size, kv_layout),
                          SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=16),
                          ParallelConfig(tp=tp), device, cuda_graph=cuda_graph,
                          graph_batch_sizes=graph_batch_sizes)
    if spec is not None:
        return build_speculative_engine(config, WEIGHTS, spec)
    return build_engine(config, WEIGHTS)


@dataclass
class Trace:
    """What a served workload did, step by step."""

    outputs: list[list[int]] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    static: list[bool] = field(default_factory=list)  # whether the step took the static path
    buckets: set[tuple[int, int]] = field(default_factory=set)


def record_outputs(engine: LLMEngine, record: Callable[[Batch, ForwardOutput], None]) -> None:
    """Instrument the engine's runner: `record` sees every batch and what its forward gave."""
    execute = engine.runner.execute

    def recording(batch: Batch) -> ForwardOutput:
        output = execute(batch)
        record(batch, output)
        return output

    engine.runner.execute = recording  # type: ignore[method-assign]


def serve(engine: LLMEngine, waves: list[tuple[int, list[int], list[int]]] = WAVES) -> Trace:
    """Run `waves` to completion, recording every step; allocator books checked per step."""
    trace = Trace()
    graphs = engine.runner.graphs

    def record(batch: Batch, output: ForwardOutput) -> None:
        trace.batches.append(batch)
        trace.logits.append(output.logits.clone())
        trace.static.append(engine.runner.graph_stats["static"] > sum(trace.static))
        if trace.static[-1] and graphs is not None:
            trace.buckets.add(graphs.bucket(batch))

    record_outputs(engine, record)
    generator = torch.Generator().manual_seed(0)
    requests, step = [], 0
    while step <= waves[-1][0] or engine.has_unfinished():
        for at, lengths, max_tokens in waves:
            if at == step:
                requests += [engine.add_request(
                    torch.randint(3, CONFIG.vocab_size, (n,), generator=generator).tolist(),
                    SamplingParams(max_tokens=m, ignore_eos=True))
                    for n, m in zip(lengths, max_tokens, strict=True)]
        engine.step()
        engine.allocator.check_invariants()
        step += 1
    engine.allocator.check_invariants(expect_all_free=True)
    trace.outputs = [r.output_token_ids for r in requests]
    return trace


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_static_path_tokens_and_logits_equal_eager(kv_layout: str, page_size: int) -> None:
    """Greedy tokens and every step's logits match the default engine across buckets."""
    eager = serve(make_engine(False, kv_layout, page_size))
    static = serve(make_engine(True, kv_layout, page_size))
    assert static.outputs == eager.outputs
    assert len(static.logits) == len(eager.logits)
    for ours, reference in zip(static.logits, eager.logits, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    assert {b for b, _ in static.buckets} >= {1, 2, 4, 8, 16}
    assert len({p for _, p in static.buckets}) >= 3


def test_only_pure_decodes_that_fit_take_the_static_path() -> None:
    """Prefill, mixed and oversized batches run eagerly; every other batch runs static."""
    engine = make_engine(True, graph_batch_sizes=(1, 2, 4))
    trace = serve(engine)
    expected = [b.is_pure_decode and len(b.chunks) <= 4 for b in trace.batches]
    assert trace.static == expected
    assert any(b.is_pure_decode and len(b.chunks) > 4 for b in trace.batches)
    assert any(not b.is_pure_decode for b in trace.batches)
    stats = engine.runner.graph_stats
    assert stats == {"static": sum(expected), "replays": 0, "captures": 0,
                     "eager": len(expected) - sum(expected)}


def test_speculative_verify_chunks_run_eagerly() -> None:
    """Multi-token verify chunks fall back to eager; greedy tokens still match."""
    waves = [(0, [5, 9], [10, 12])]
    reference = serve(make_engine(False), waves)
    engine = make_engine(True, spec=SpeculativeConfig("early-exit", num_draft_tokens=2,
                                                      draft_layers=1))
    trace = serve(engine, waves)
    assert trace.outputs == reference.outputs
    verify_steps = [any(c.num_tokens > 1 and c.start >= c.request.num_prompt_tokens
                        for c in b.chunks) for b in trace.batches]
    assert any(verify_steps)
    assert not any(s for s, v in zip(trace.static, verify_steps, strict=True) if v)


def test_one_token_prefill_chunks_take_the_static_path() -> None:
    """With chunk_size 1 prompt tokens run static too, the non-sampling rows included."""
    waves = [(0, [6, 3, 8], [4, 6, 3])]
    reference = serve(make_engine(False, chunk_size=1), waves)
    trace = serve(make_engine(True, chunk_size=1), waves)
    assert trace.outputs == reference.outputs
    assert all(trace.static)


def test_graphs_with_tp_rank_processes_are_refused() -> None:
    """A decode graph replays one process's kernels: with TP 2 it is a ConfigError, not a
    silently eager run."""
    with pytest.raises(ConfigError, match="not with TP 2"):
        make_engine(True, tp=2)


def decoding_engine(kv_layout: str = "NHD", num_requests: int = 3) -> LLMEngine:
    """A static-path engine whose requests have finished prefill: the next step is decode."""
    engine = make_engine(True, kv_layout)
    for n in range(num_requests):
        engine.add_request(list(range(3, 8 + 3 * n)), SamplingParams(max_tokens=8,
                                                                     ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    return engine


def slot_mask(engine: LLMEngine, slots: set[tuple[int, int]]) -> torch.Tensor:
    """Bool mask over the cache buffer: True at every layer, head and dim of `slots`."""
    cache = engine.kv_cache
    marked = torch.zeros(cache.num_pages, cache.page_size, dtype=torch.bool)
    for page, offset in slots:
        marked[page, offset] = True
    if cache.kv_layout == "NHD":  # [layers, pages, 2, page_size, heads, dim]
        return marked[None, :, None, :, None, None].expand_as(cache.buffer)
    return marked[None, :, None, None, :, None].expand_as(cache.buffer)


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_padding_rows_write_only_the_padding_page(kv_layout: str) -> None:
    """Three decodes in a bucket of four: the only slots that change are each request's new
    token and the padding page's slot 0; every free or unused slot keeps its sentinel."""
    engine = decoding_engine(kv_layout)
    running = list(engine.scheduler.running)
    cached = {(r.page_ids[p // engine.kv_cache.page_size], p % engine.kv_cache.page_size)
              for r in running for p in range(r.num_computed_tokens)}
    buffer = engine.kv_cache.buffer
    buffer.masked_fill_(~slot_mask(engine, cached), 777.0)
    before = buffer.clone()
    static_before = engine.runner.graph_stats["static"]
    engine.step()
    assert engine.runner.graph_stats["static"] == static_before + 1
    page_size = engine.kv_cache.page_size
    new = {(r.page_ids[(r.num_computed_tokens - 1) // page_size],
            (r.num_computed_tokens - 1) % page_size) for r in running}
    padding = engine.runner.graphs.padding_page
    changed = buffer != before
    assert not (changed & ~slot_mask(engine, new | {(padding, 0)})).any()
    assert changed[slot_mask(engine, {(padding, 0)})].any(), "padding rows wrote elsewhere"
    assert changed[slot_mask(engine, new)].all()


def test_stale_buffer_contents_never_reach_results() -> None:
    """Garbage in every static input slot before a step changes nothing in its output."""
    clean, dirty = decoding_engine(), decoding_engine()
    graphs = dirty.runner.graphs
    graphs._inputs.random_(0, dirty.kv_cache.num_pages - 1, generator=torch.Generator()
                           .manual_seed(1))
    outputs = []
    for engine in (clean, dirty):
        record_outputs(engine, lambda b, out: outputs.append(out))
        engine.step()
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=0, atol=0)
    torch.testing.assert_close(clean.kv_cache.buffer, dirty.kv_cache.buffer, rtol=0, atol=0)


def test_layer_counter_moves_num_layers_per_static_step() -> None:
    """Each static-path step bumps the model's counter exactly once per layer."""
    engine = decoding_engine()
    counter = engine.model.layer_counter = LayerCounter()
    for _ in range(4):
        before, static = counter.read(), engine.runner.graph_stats["static"]
        engine.step()
        assert engine.runner.graph_stats["static"] == static + 1
        assert counter.read() - before == CONFIG.num_layers


def test_request_past_the_pages_buckets_runs_eagerly() -> None:
    """A request holding more pages than the widest bucket is not padded, it runs eagerly."""
    engine = decoding_engine(num_requests=1)
    request = engine.scheduler.running[0]
    pages = -(-(request.num_computed_tokens + 1) // engine.kv_cache.page_size)
    graphs = engine.runner.graphs
    engine.runner.graphs = DecodeGraphs(engine.model, engine.kv_cache, graphs.padding_page,
                                        max_pages=pages - 1)
    eager = engine.runner.graph_stats["eager"]
    engine.step()
    assert engine.runner.graph_stats["static"] == 0
    assert engine.runner.graph_stats["eager"] == eager + 1


def test_padding_page_is_kept_out_of_the_allocator() -> None:
    """With cuda_graph the last page pads; without it the engine is as before."""
    default, graphed = make_engine(False), make_engine(True)
    assert default.runner.graphs is None
    assert default.allocator.num_pages == default.kv_cache.num_pages
    assert graphed.allocator.num_pages == graphed.kv_cache.num_pages - 1
    assert graphed.runner.graphs.padding_page == graphed.kv_cache.num_pages - 1


def test_buckets() -> None:
    """Pages buckets are powers of two capped by the maximum; lookups pick the smallest fit."""
    assert page_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert page_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert smallest_bucket(5, (1, 2, 4, 8)) == 8
    assert smallest_bucket(9, (1, 2, 4, 8)) is None
    assert useful_batch_sizes((1, 2, 4, 8, 16), max_num_seqs=3) == (1, 2, 4)
    assert useful_batch_sizes((1, 2, 4), max_num_seqs=64) == (1, 2, 4)


@pytest.mark.parametrize("sizes", [(), (0, 1), (4, 2), (2, 2)])
def test_bad_graph_batch_sizes_are_refused(sizes: tuple[int, ...]) -> None:
    """Empty, non-positive or unsorted buckets fail at config time."""
    with pytest.raises(ConfigError, match="graph_batch_sizes"):
        EngineConfig(CONFIG, graph_batch_sizes=sizes)


def test_cuda_graph_needs_a_spare_page() -> None:
    """A one-page cache has no room for the padding page."""
    with pytest.raises(ConfigError, match="padding page"):
        EngineConfig(CONFIG, CacheConfig(page_size=4, num_pages=1), cuda_graph=True)



class OpRecorder(TorchDispatchMode):
    """Records every aten op (and its arguments) run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.calls.append((func.overloadpacket.__name__, args))
        return func(*args, **(kwargs or {}))


# Ops that read a tensor value on the host (`.item()`, `if t:`), size an output by values, or
# build a tensor from Python data: none may run in a captured forward.
HOST_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique",
            "_unique2", "lift_fresh", "lift_fresh_copy"}


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_static_forward_is_capturable(kv_layout: str) -> None:
    """The forward a CUDA graph captures reads no tensor value on the host, indexes with no
    bool mask and builds no tensor from Python data; it bumps the counter once per layer."""
    engine = decoding_engine(kv_layout)
    counter = engine.model.layer_counter = LayerCounter()
    graphs = engine.runner.graphs
    graphs._fill_padding((4, 2))
    with torch.inference_mode(), OpRecorder() as recorder:
        graphs._forward((4, 2))
    names = [name for name, _ in recorder.calls]
    assert not HOST_OPS & set(names)
    for name, args in recorder.calls:
        if name in ("index", "index_put_", "index_put"):
            assert all(i is None or i.dtype != torch.bool for i in args[1]), name
    assert names.count("add_") == CONFIG.num_layers
    assert counter.read() == CONFIG.num_layers
