"""Captured decode graphs on a GPU: replay equals eager, and drives the mapped layer counter (S3b).

Everything here needs CUDA and is skipped without it; the CPU file `test_graph_runner.py` covers
the buckets, padding and static buffers. The workload and its step-by-step trace come from there.
"""

from __future__ import annotations

import pytest
import torch

from disagg.engine.request import SamplingParams
from disagg.model.layer_counter import LayerCounter
from tests.disagg.engine.test_cuda_graphs import CONFIG, WAVES, make_engine, serve
from transfer_core.poller import CounterPoller

pytestmark = pytest.mark.gpu_only


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: graph capture and replay need one")


@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_replay_matches_eager_on_cuda(kv_layout: str) -> None:
    """Captured replays give the eager engine's greedy tokens and, step by step, its logits."""
    eager = serve(make_engine(False, kv_layout, device="cuda"))
    engine = make_engine(True, kv_layout, device="cuda")
    static = serve(engine)
    assert static.outputs == eager.outputs
    for ours, reference in zip(static.logits, eager.logits, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    stats = engine.runner.graph_stats
    assert stats["replays"] == stats["static"] > 0
    assert 0 < stats["captures"] == len(static.buckets)


def test_replays_bump_the_mapped_counter_once_per_layer() -> None:
    """Through a CounterPoller on the mapped word: every step, captured or eager, moves it by
    num_layers, including the step that captures (warm-up forwards bump a scratch counter)."""
    engine = make_engine(True, device="cuda")
    counter = engine.model.layer_counter = LayerCounter.for_device("cuda")
    reports: list[tuple[int, int]] = []
    with CounterPoller([counter.poll_target],
                       lambda _, old, new: reports.append((old, new))) as poller:
        start, expected = counter.read(), counter.read()
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        requests = [engine.add_request(list(range(3, 3 + n)), params) for n in (5, 9, 2)]
        while engine.has_unfinished():
            engine.step()
            torch.cuda.synchronize()
            expected += CONFIG.num_layers
            assert counter.read() == expected  # no extra bumps (warm-up, capture)
            poller.wait_for(0, expected)
            assert poller.last_reported(0) == expected
    assert all(r.is_finished for r in requests)
    assert engine.runner.graph_stats["replays"] > 0
    assert engine.runner.graph_stats["captures"] > 0
    assert reports[0][0] == start
    assert reports[-1][1] == expected
    assert all(b[0] == a[1] for a, b in zip(reports, reports[1:], strict=False))


def test_capture_all_leaves_nothing_to_capture_lazily() -> None:
    """After `capture_all()`, a whole workload replays without one more capture."""
    engine = make_engine(True, graph_batch_sizes=(1, 2, 4, 8, 16), device="cuda")
    graphs = engine.runner.graphs
    graphs.capture_all()
    captured = engine.runner.graph_stats["captures"]
    assert captured == len(graphs.batch_sizes) * len(graphs.page_buckets)
    trace = serve(engine, WAVES)
    assert engine.runner.graph_stats["captures"] == captured
    assert engine.runner.graph_stats["replays"] == sum(trace.static) > 0


def test_a_new_counter_is_captured_into_new_graphs() -> None:
    """Replacing the model's counter drops the old graphs: the new one is bumped, not the old."""
    engine = make_engine(True, device="cuda")
    first = engine.model.layer_counter = LayerCounter.for_device("cuda")
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):  # prefill, then two captured decode steps
        engine.step()
    captures = engine.runner.graph_stats["captures"]
    second = engine.model.layer_counter = LayerCounter.for_device("cuda")
    torch.cuda.synchronize()
    first_value = first.read()
    engine.step()
    torch.cuda.synchronize()
    assert engine.runner.graph_stats["captures"] == captures + 1
    assert second.read() == CONFIG.num_layers
    assert first.read() == first_value


def test_a_host_counter_keeps_cuda_decodes_eager() -> None:
    """A counter a graph cannot bump (a CPU tensor) sends decode steps down the eager path."""
    engine = make_engine(True, device="cuda")
    engine.model.layer_counter = LayerCounter()
    engine.add_request([3, 4, 5])
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.graph_stats["static"] == 0
    assert engine.runner.graph_stats["captures"] == 0
