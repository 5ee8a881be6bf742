"""Tests of `transfer_core.cuda.driver`: mapped counters driven by CUDA graphs (S3b).

The CPU tests check that the module imports and fails with `CudaError` without a GPU; the
`gpu_only` ones check that a captured graph's bumps reach the poller, every layer of them.
"""

from __future__ import annotations

import sys

import pytest
import torch

from transfer_core.cuda.driver import check_cu, cuda_available, load_driver
from transfer_core.cuda.mapped_counter import MappedCounter
from transfer_core.errors import CudaError
from transfer_core.poller import CounterPoller

HAS_GPU = torch.cuda.is_available() and cuda_available()
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA device and cuda-python")
needs_no_gpu = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without CUDA")


@needs_no_gpu
def test_mapped_counter_without_gpu_raises_cuda_error() -> None:
    """Without a driver or device, allocation fails with a CUresult name, not a crash."""
    with pytest.raises(CudaError, match="CUDA_ERROR_") as info:
        MappedCounter()
    assert info.value.call in ("cuInit", "import cuda.bindings")


@needs_no_gpu
def test_cuda_available_is_false_without_gpu() -> None:
    """The probe answers False instead of raising."""
    assert cuda_available() is False


def test_check_cu_names_the_cuda_result() -> None:
    """A failing CUresult becomes CudaError carrying the call and the result's name."""
    driver = load_driver()
    with pytest.raises(CudaError, match="cuMemMap failed: CUDA_ERROR_INVALID_VALUE"):
        check_cu("cuMemMap", (driver.CUresult.CUDA_ERROR_INVALID_VALUE,))


def test_check_cu_unpacks_values() -> None:
    """Success returns nothing, the one value, or the tuple of values."""
    ok = load_driver().CUresult.CUDA_SUCCESS
    assert check_cu("f", (ok,)) is None
    assert check_cu("f", (ok, 7)) == 7
    assert check_cu("f", (ok, 7, 8)) == (7, 8)


def test_missing_cuda_python_is_a_cuda_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cuda-python the loader raises CudaError, not ImportError."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.cuda", None)
    with pytest.raises(CudaError, match="cuda-python is not installed"):
        load_driver()


@pytest.mark.gpu_only
@needs_gpu
def test_device_and_host_views_share_the_word() -> None:
    """A bump through the CUDA view is read back through the host view and address."""
    with MappedCounter() as counter:
        counter.device_tensor.add_(3)
        torch.cuda.synchronize()
        assert counter.value == 3
        assert counter.host_tensor.data_ptr() == counter.host_address


@pytest.mark.gpu_only
@needs_gpu
def test_graph_replays_bump_counter_seen_by_poller_for_every_layer() -> None:
    """Each replay of a captured graph bumps once per layer; the poller reports every step."""
    num_layers, num_replays = 4, 20
    counter = MappedCounter()
    x = torch.randn(256, 256, device="cuda")

    def forward() -> None:
        h = x
        for _ in range(num_layers):
            h = h @ x  # stands in for attention + output projection
            counter.device_tensor.add_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up outside capture, as torch requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize()

    reports: list[tuple[int, int]] = []
    with CounterPoller([counter], lambda _, old, new: reports.append((old, new))) as poller:
        start = counter.value
        for _ in range(num_replays):
            graph.replay()
        torch.cuda.synchronize()
        poller.wait_for(0, start + num_layers * num_replays)
    assert reports[0][0] == start
    assert reports[-1][1] == start + num_layers * num_replays
    assert all(b[0] == a[1] for a, b in zip(reports, reports[1:], strict=False))
    del graph
    counter.close()
