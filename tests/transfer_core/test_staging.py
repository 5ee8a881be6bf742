"""Tests of `transfer_core.staging`: the memory-path choice and the staged region (S5, S5a).

The choice is a table over (requested path, tensor device, engine FI_HMEM); CUDA rows use a
stand-in with a CUDA `device`, since only the device is read. The staged region is exercised
on CPU by forcing "staged": copies must move exactly the named pages, and a paged write from
a staged source into a staged destination, staged in, must arrive byte for byte.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from transfer_core import staging
from transfer_core.engine import TransferEngine
from transfer_core.errors import BoundsError, FabricError
from transfer_core.staging import (
    MemoryPath,
    RegisteredKV,
    choose_memory_path,
    page_runs,
    register_kv,
)
from transfer_core.transport import PagedWrite

NUM_LAYERS, NUM_PAGES, PAGE_NUMEL = 3, 8, 256  # 1 KiB pages of float32
CUDA_LIKE = SimpleNamespace(device=torch.device("cuda", 0))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def engine() -> Iterator[TransferEngine]:
    with TransferEngine("tcp") as e:
        yield e


def make_kv(fill: str = "arange", device: str = "cpu") -> torch.Tensor:
    """``[num_layers, num_pages, page_numel]``: distinct values per element, or zeros."""
    shape = (NUM_LAYERS, NUM_PAGES, PAGE_NUMEL)
    if fill == "zeros":
        return torch.zeros(shape, device=device)
    return torch.arange(1, np.prod(shape) + 1, dtype=torch.float32).reshape(shape).to(device)


@pytest.mark.parametrize(("requested", "kind"), [
    ("auto", "host"), ("host", "host"), ("staged", "staged")])
def test_cpu_tensor_paths(engine: TransferEngine, requested: str, kind: str) -> None:
    """CPU memory registers directly unless staging is forced."""
    assert choose_memory_path(make_kv(), engine, requested).kind == kind


@pytest.mark.parametrize(("requested", "kind"), [("auto", "staged"), ("staged", "staged")])
def test_cuda_tensor_without_hmem_is_staged(engine: TransferEngine, requested: str,
                                            kind: str) -> None:
    """A CUDA tensor on an engine without FI_HMEM goes through staging, saying why."""
    path = choose_memory_path(CUDA_LIKE, engine, requested)  # type: ignore[arg-type]
    assert path.kind == kind
    if requested == "auto":
        assert "without FI_HMEM" in path.reason
        assert engine.provider in path.reason


def test_cuda_tensor_with_hmem_registers_directly() -> None:
    """auto picks hmem when the engine's provider was opened with FI_HMEM."""
    hmem_engine = SimpleNamespace(supports_hmem=True, provider="efa")
    path = choose_memory_path(CUDA_LIKE, hmem_engine)  # type: ignore[arg-type]
    assert path.kind == "hmem"
    assert "efa" in path.reason


def test_hmem_refused_without_fi_hmem(engine: TransferEngine) -> None:
    """Insisting on hmem over a provider without FI_HMEM names the provider and the reason."""
    with pytest.raises(ValueError, match=rf"'hmem' is unavailable: provider '{engine.provider}'"
                                         r" was opened without FI_HMEM"):
        choose_memory_path(CUDA_LIKE, engine, "hmem")  # type: ignore[arg-type]


@pytest.mark.parametrize(("tensor", "requested", "message"), [
    (make_kv(), "hmem", "needs a CUDA tensor"),
    (CUDA_LIKE, "host", "cannot register cuda:0 memory"),
    (make_kv(), "gpu", "unknown KV memory path 'gpu'"),
    (torch.empty(2, 2, device="meta"), "auto", "on device meta"),
])
def test_impossible_requests_raise(engine: TransferEngine, tensor: Any, requested: str,
                                   message: str) -> None:
    """Bad or impossible requests are ValueErrors naming the value."""
    with pytest.raises(ValueError, match=message):
        choose_memory_path(tensor, engine, requested)


def test_engine_validates_its_default_path() -> None:
    """TransferEngine(memory_path=...) refuses unknown values; the default is auto, no hmem."""
    with pytest.raises(ValueError, match="unknown memory_path 'pinned'"):
        TransferEngine("tcp", memory_path="pinned")
    with TransferEngine("tcp") as e:
        assert e.memory_path == "auto"
        assert not e.supports_hmem


def test_page_runs_groups_consecutive_ids() -> None:
    """Unsorted, repeated ids become sorted half-open runs."""
    assert page_runs([5, 1, 2, 2, 7, 6, 0]) == [(0, 3), (5, 8)]
    assert page_runs([]) == []


def test_host_path_registers_the_tensor_itself(engine: TransferEngine) -> None:
    """host: the region is the tensor, there is no shadow and staging is a no-op."""
    kv = make_kv()
    registered = register_kv(engine, kv, "host-kv", "host")
    try:
        assert registered.region.ptr == kv.data_ptr()
        assert registered.shadow is None
        registered.stage_out(0, [1, 2])
        registered.stage_in([1, 2])
        assert registered.staged_bytes == 0
    finally:
        registered.close(engine)


@pytest.mark.parametrize("path", ["host", "staged"])
def test_sources_register_without_remote_write(engine: TransferEngine, path: str) -> None:
    """A prefiller's KV (remote_write=False) is read-only to peers on either path, the shadow
    included; a decoder's (the default) is writable."""
    source = register_kv(engine, make_kv(), "src-kv", path, remote_write=False)
    target = register_kv(engine, make_kv(), "dst-kv", path)
    try:
        assert (source.descriptor.writable, target.descriptor.writable) == (False, True)
    finally:
        source.close(engine)
        target.close(engine)


@pytest.fixture
def staged(engine: TransferEngine) -> Iterator[RegisteredKV]:
    registered = register_kv(engine, make_kv(), "staged-kv", "staged")
    yield registered
    registered.close(engine)


def test_staged_region_is_the_shadow(staged: RegisteredKV) -> None:
    """staged: the fabric sees a zeroed host shadow of the tensor's shape, not the tensor."""
    assert staged.shadow is not None
    assert staged.staged
    assert staged.region.ptr == staged.shadow.data_ptr() != staged.tensor.data_ptr()
    assert staged.shadow.shape == staged.tensor.shape
    assert not staged.shadow.any()
    assert staged.path == MemoryPath("staged", "cpu memory, staging requested")


def test_stage_out_copies_only_those_pages_of_that_layer(staged: RegisteredKV) -> None:
    """stage_out(1, pages) fills exactly those pages of layer 1 of the shadow."""
    staged.stage_out(1, [6, 2, 5])
    assert staged.shadow is not None
    touched = torch.zeros(NUM_LAYERS, NUM_PAGES, dtype=torch.bool)
    touched[1, [2, 5, 6]] = True
    assert torch.equal(staged.shadow[touched], staged.tensor[touched])
    assert not staged.shadow[~touched].any()
    assert staged.staged_bytes == 3 * PAGE_NUMEL * 4


def test_stage_out_of_a_run_of_layers_copies_those_pages_of_each(staged: RegisteredKV) -> None:
    """stage_out(range(1, 3), pages): those pages of layers 1 and 2, nothing else."""
    staged.stage_out(range(1, 3), [0, 4])
    assert staged.shadow is not None
    touched = torch.zeros(NUM_LAYERS, NUM_PAGES, dtype=torch.bool)
    touched[1:3, [0, 4]] = True
    assert torch.equal(staged.shadow[touched], staged.tensor[touched])
    assert not staged.shadow[~touched].any()
    assert staged.staged_bytes == 4 * PAGE_NUMEL * 4


def test_stage_in_copies_every_layer_of_those_pages(staged: RegisteredKV) -> None:
    """stage_in(pages) overwrites those pages in every layer of the tensor, nothing else."""
    assert staged.shadow is not None
    before = staged.tensor.clone()
    staged.shadow.fill_(-1.0)
    staged.stage_in([4, 3])
    assert (staged.tensor[:, 3:5] == -1.0).all()
    keep = torch.ones(NUM_PAGES, dtype=torch.bool)
    keep[3:5] = False
    assert torch.equal(staged.tensor[:, keep], before[:, keep])


def test_stage_in_of_some_layers_leaves_the_others(staged: RegisteredKV) -> None:
    """stage_in(pages, layers) overwrites those pages in those layers only: a receiver takes a
    request's body in while its last layer is still landing in the shadow."""
    assert staged.shadow is not None
    before = staged.tensor.clone()
    staged.shadow.fill_(-1.0)
    staged.stage_in([4, 3], range(NUM_LAYERS - 1))
    assert (staged.tensor[:-1, 3:5] == -1.0).all()
    assert torch.equal(staged.tensor[-1], before[-1])
    assert torch.equal(staged.tensor[:, :3], before[:, :3])


def test_pages_outside_the_tensor_are_refused(staged: RegisteredKV) -> None:
    """A page id past the end is a BoundsError, not a silently shorter copy."""
    with pytest.raises(BoundsError, match="outside"):
        staged.stage_out(0, [NUM_PAGES - 1, NUM_PAGES])


def staged_transfer(device: str, pages: list[int], dst_pages: list[int]) -> tuple:
    """Write `pages` of every layer from a staged source to a staged destination (two tcp
    engines in this process), stage in, return (source tensor, destination tensor)."""
    path = "staged" if device == "cpu" else "auto"  # auto must pick staging by itself
    with TransferEngine("tcp") as a, TransferEngine("tcp") as b:
        src = register_kv(a, make_kv(device=device), "src", path)
        dst = register_kv(b, make_kv("zeros", device), "dst", path)
        assert src.staged
        assert dst.staged
        reached = threading.Event()
        b.expect_imm_count(7, NUM_LAYERS * len(pages), reached.set)
        page_nbytes, layer_nbytes = PAGE_NUMEL * 4, NUM_PAGES * PAGE_NUMEL * 4
        for layer in range(NUM_LAYERS):
            src.stage_out(layer, pages)
            a.post_paged_writes(PagedWrite(src.region, pages, page_nbytes, layer * layer_nbytes,
                                             dst.descriptor, dst_pages, page_nbytes,
                                             layer * layer_nbytes, page_nbytes, 7))
        assert reached.wait(10.0), "writes did not land"
        assert not dst.tensor.any(), "writes must land in the shadow, not the tensor"
        dst.stage_in(dst_pages)
        return src.tensor.cpu(), dst.tensor.cpu()


@pytest.mark.fabric
def test_staged_to_staged_transfer_is_byte_exact() -> None:
    """Pages 1, 2, 6 of every layer land on pages 0, 4, 5 of the destination, exactly."""
    src, dst = staged_transfer("cpu", [1, 2, 6], [0, 4, 5])
    assert torch.equal(dst[:, [0, 4, 5]].view(torch.int32), src[:, [1, 2, 6]].view(torch.int32))
    assert not dst[:, [1, 2, 3, 6, 7]].any()


@pytest.mark.gpu_only
@needs_cuda
def test_cuda_tensors_auto_stage_on_a_provider_without_hmem() -> None:
    """CUDA KV on tcp (no FI_HMEM): auto stages both sides and the pages arrive exactly."""
    src, dst = staged_transfer("cuda", [1, 2, 6], [0, 4, 5])
    assert torch.equal(dst[:, [0, 4, 5]], src[:, [1, 2, 6]])
    assert not dst[:, [1, 2, 3, 6, 7]].any()


def test_auto_falls_back_to_staging_when_hmem_registration_fails(
        engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """auto chose hmem but the provider refuses the device memory: staged, with the error."""
    kv = make_kv()

    def refuse_the_tensor(buffer: Any, name: str, *, remote_write: bool) -> Any:
        if buffer is kv:
            raise FabricError("fi_mr_regattr", 95, "Operation not supported")
        return engine.register_memory(buffer, name, remote_write=remote_write)

    hmem_engine = SimpleNamespace(memory_path="auto", register_memory=refuse_the_tensor)
    monkeypatch.setattr(staging, "choose_memory_path",
                        lambda *_: MemoryPath("hmem", "stand-in for a CUDA tensor"))
    registered = register_kv(hmem_engine, kv, "fallback")  # type: ignore[arg-type]
    try:
        assert registered.staged
        assert "fi_mr_regattr" in registered.path.reason
    finally:
        registered.close(engine)
