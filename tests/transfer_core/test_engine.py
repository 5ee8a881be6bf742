"""In-process `TransferEngine` tests: two engines in this process over tcp and shm (S5).

Fast checks of the API's contracts (registration, domains, callbacks, close); the
cross-process behaviour is in test_engine_two_process.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from transfer_core import domain_worker, memory
from transfer_core import engine as engine_module
from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.memory import EngineAddress, MemoryRegionDescriptor
from transfer_core.pyfabric import lib
from transfer_core.transport import PagedWrite

PAGE = 4096
Engines = tuple[TransferEngine, TransferEngine]


@pytest.fixture(params=["tcp", "shm"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    a, b = TransferEngine(request.param), TransferEngine(request.param, num_domains=2)
    yield a, b
    a.close()
    b.close()


def _wait(event: threading.Event) -> None:
    assert event.wait(10.0), "callback did not fire"


def test_address_lists_every_domain(engines: Engines) -> None:
    """The address is an EngineAddress with one endpoint per domain."""
    _, b = engines
    address = EngineAddress.from_bytes(b.address)
    assert address.provider == b.provider
    assert len(address.domains) == 2


def test_tensor_target_receives_striped_pages(engines: Engines) -> None:
    """Pages written into a torch tensor of a 2-domain engine arrive; both domains count."""
    a, b = engines
    src = torch.arange(64 * PAGE // 4, dtype=torch.int32)
    dst = torch.zeros_like(src)
    src_mr, _ = a.register_memory(src)
    _, dst_desc = b.register_memory(dst)
    reached = threading.Event()
    b.expect_imm_count(1, 64, reached.set)
    a.post_paged_writes(
        PagedWrite(src_mr, np.arange(64), PAGE, 0, dst_desc, np.arange(64)[::-1], PAGE, 0, PAGE, 1)
    )
    _wait(reached)
    assert torch.equal(dst.view(64, -1).flip(0), src.view(64, -1))


def test_per_page_immediates_are_counted_under_each_value(engines: Engines) -> None:
    """One paged write carrying two requests' pages (`imms`): each value's counter fires at
    its own count, the pages land in place, and nothing is left counted."""
    a, b = engines
    src = np.arange(8 * PAGE, dtype=np.uint32).view(np.uint8)[: 8 * PAGE].copy()
    dst = np.zeros_like(src)
    src_mr, _ = a.register_memory(src, remote_write=False)
    _, dst_desc = b.register_memory(dst)
    fired = {11: threading.Event(), 22: threading.Event()}
    b.expect_imm_count(11, 3, fired[11].set)
    b.expect_imm_count(22, 5, fired[22].set)
    a.post_paged_writes(PagedWrite(src_mr, np.arange(8), PAGE, 0, dst_desc, np.arange(8)[::-1],
                                   PAGE, 0, PAGE, None, imms=[11, 22, 11, 22, 22, 11, 22, 22]))
    _wait(fired[11])
    _wait(fired[22])
    assert np.array_equal(dst.reshape(8, PAGE)[::-1], src.reshape(8, PAGE))
    assert (b.pending_imm_counts(), b.imm_counted(11), b.imm_counted(22)) == ({}, 0, 0)


def test_two_domains_stripe_page_ranges() -> None:
    """A 2-domain sender cuts a paged write into two ranges, one per domain."""
    with TransferEngine("tcp", num_domains=2) as a, TransferEngine("tcp") as b:
        src_mr, _ = a.register_memory(np.ones(16 * PAGE, np.uint8))
        _, dst_desc = b.register_memory(np.zeros(16 * PAGE, np.uint8))
        done = threading.Event()
        pages = np.arange(16)
        write = PagedWrite(src_mr, pages, PAGE, 0, dst_desc, pages, PAGE, 0, PAGE, 5)
        a.post_paged_writes(write, done.set)
        _wait(done)
        assert [s.writes_completed for s in a.stats()] == [8, 8]


def test_bytes_source_is_read_only_target() -> None:
    """bytes register as a source; writing into their descriptor is refused."""
    with TransferEngine("tcp") as a:
        src_mr, src_desc = a.register_memory(b"x" * PAGE)
        assert not src_mr.writable
        with pytest.raises(ValueError, match="read-only"):
            a.post_write(src_mr, 0, PAGE, None, src_desc, 0)


def test_cuda_memory_needs_hmem(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without FI_HMEM a CUDA buffer is refused with a message naming the fix."""
    fake = memory.BufferInfo(ptr=4096, nbytes=4096, writable=True, cuda_device=0, keepalive=None)
    monkeypatch.setattr("transfer_core.engine.resolve_buffer", lambda _: fake)
    with TransferEngine("tcp") as a, pytest.raises(ValueError, match="FI_HMEM"):
        a.register_memory(object())


def test_provider_mismatch_is_refused() -> None:
    """A tcp engine cannot write into a region described by a shm engine."""
    with TransferEngine("tcp") as a, TransferEngine("shm") as b:
        src_mr, _ = a.register_memory(np.zeros(PAGE, np.uint8))
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        with pytest.raises(ValueError, match="provider"):
            a.post_write(src_mr, 0, PAGE, None, desc, 0)


def test_callback_exception_is_raised_on_next_call(engines: Engines) -> None:
    """A raising on_done is not swallowed: the owner's next engine call re-raises it."""
    a, b = engines
    src_mr, _ = a.register_memory(np.zeros(PAGE, np.uint8))
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    ran = threading.Event()

    def explode() -> None:
        ran.set()
        raise RuntimeError("boom")

    a.post_imm(1, desc, explode)
    _wait(ran)
    raised = None
    for _ in range(10_000):  # the error is stored just after the callback returns
        try:
            a.post_imm(2, desc)
        except RuntimeError as exc:
            raised = exc
            break
        threading.Event().wait(0.001)
    assert str(raised) == "boom"


def test_expectation_already_met_fires_on_engine_thread(engines: Engines) -> None:
    """expect_imm_count after the arrivals fires at once, on an engine thread."""
    a, b = engines
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    sent = threading.Event()
    a.post_imm(9, desc, sent.set)
    _wait(sent)
    for _ in range(5000):
        if b.imm_counted(9) == 1:
            break
        threading.Event().wait(0.002)
    fired_on: list[str] = []
    reached = threading.Event()
    b.expect_imm_count(
        9, 1, lambda: (fired_on.append(threading.current_thread().name), reached.set())
    )
    _wait(reached)
    assert fired_on[0].startswith("transfer-domain-")


def test_closed_engine_refuses_work() -> None:
    """After close() (idempotent) every submit raises TransferError."""
    a = TransferEngine("tcp")
    src_mr, desc = a.register_memory(np.zeros(PAGE, np.uint8))
    a.close()
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.post_write(src_mr, 0, PAGE, None, desc, 0)


def test_close_leaves_no_shm_files() -> None:
    """shm endpoints create /dev/shm/<pid>:... files; close() removes them (G12)."""
    mine = f"{os.getpid()}:"
    before = {f for f in os.listdir("/dev/shm") if f.startswith(mine)}
    with TransferEngine("shm", num_domains=2) as a:
        a.register_memory(np.zeros(PAGE, np.uint8))
        assert len({f for f in os.listdir("/dev/shm") if f.startswith(mine)} - before) == 2
    assert {f for f in os.listdir("/dev/shm") if f.startswith(mine)} == before


def test_close_from_callback_is_refused(engines: Engines) -> None:
    """close() inside an engine callback would join its own thread: it raises instead."""
    a, b = engines
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    errors: list[RuntimeError] = []
    ran = threading.Event()

    def close_inside() -> None:
        try:
            a.close()
        except RuntimeError as exc:
            errors.append(exc)
        ran.set()

    a.post_imm(1, desc, close_inside)
    _wait(ran)
    assert "callback thread" in str(errors[0])


# Who can write what (S5): keys, access flags, immediates nobody expects.


def _forged(desc: MemoryRegionDescriptor) -> MemoryRegionDescriptor:
    """What an attacker holding the key sends: the descriptor, claiming it is writable."""
    return dataclasses.replace(desc, writable=True)


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_memory_keys_are_random_64_bit(provider: str) -> None:
    """Keys are drawn at random from 64 bits, distinct within a domain: not 1, 2, 3, ..."""
    with TransferEngine(provider, num_domains=2) as a:
        keys = [key for _ in range(6)
                for _, key in a.register_memory(np.zeros(PAGE, np.uint8))[1].domains]
    assert len(set(keys)) == len(keys)
    assert max(keys) > 2**40  # sequential keys from 1 stay tiny (odds of failing: 2^-144)


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_source_without_remote_write_cannot_be_written(provider: str) -> None:
    """A region registered with remote_write=False says read-only, and a peer that writes it
    anyway, with its real key, lands nothing: no byte, no immediate (the provider enforces
    the missing FI_REMOTE_WRITE; tcp then drops the connection, shm completes silently). The
    same write into a writable region of the same engine lands."""
    with TransferEngine(provider) as a, TransferEngine(provider) as b:
        src_mr, _ = a.register_memory(np.full(PAGE, 7, np.uint8), remote_write=False)
        source = np.zeros(PAGE, np.uint8)
        _, source_desc = b.register_memory(source, remote_write=False)
        target = np.zeros(PAGE, np.uint8)
        _, target_desc = b.register_memory(target)
        assert (source_desc.writable, target_desc.writable) == (False, True)
        with pytest.raises(ValueError, match="read-only"):
            a.post_write(src_mr, 0, PAGE, 5, source_desc, 0)
        landed = threading.Event()
        b.expect_imm_count(6, 1, landed.set)
        a.post_write(src_mr, 0, PAGE, 6, target_desc, 0)
        _wait(landed)
        finished = threading.Event()
        a.post_write(src_mr, 0, PAGE, 5, _forged(source_desc), 0, finished.set,
                       lambda _error: finished.set())
        _wait(finished)
        threading.Event().wait(0.3)  # give a wrongly placed write time to show up
        assert (b.imm_counted(5), int(source.max()), int(target.min())) == (0, 0, 7)


def test_unexpected_immediates_are_bounded_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of immediates for values nobody armed keeps at most the bound of values; the
    rest are dropped and counted in `dropped_imms`. Kept ones still count once armed."""
    monkeypatch.setattr(engine_module, "ImmCounterMap",
                        functools.partial(ImmCounterMap, max_unarmed=8))
    with TransferEngine("tcp") as a, TransferEngine("tcp") as b:
        _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
        sent = [threading.Event() for _ in range(40)]
        for imm, event in enumerate(sent, start=1):
            a.post_imm(imm, desc, event.set)
        for event in sent:
            _wait(event)
        for _ in range(2000):
            if b.dropped_imms + sum(b.imm_counted(i) for i in range(1, 41)) == 40:
                break
            threading.Event().wait(0.002)
        assert b.dropped_imms == 32
        assert [i for i in range(1, 41) if b.imm_counted(i)] == list(range(1, 9))
        reached = threading.Event()
        b.expect_imm_count(3, 1, reached.set)
        _wait(reached)


def test_expect_soon_keeps_every_domains_naps_short_until_the_counter_fires() -> None:
    """shm workers nap up to 1 ms when long idle; once an armed counter's writes are due
    (`expect_soon`), every domain naps 100 us, until that counter fires."""
    with TransferEngine("shm", num_domains=2) as engine:
        def naps() -> list[int]:
            return [d._worker.idle_nap_ns(50_000_000) for d in engine._domains]

        engine.expect_imm_count(9, 2, lambda: None)
        assert naps() == [1_000_000] * 2
        assert engine.expect_soon(9) and naps() == [100_000] * 2
        engine.imm_counters.on_imm(9, 2)
        assert naps() == [1_000_000] * 2
        assert not engine.expect_soon(9)  # fired: nothing is due any more


def test_expect_soon_at_once_makes_every_tcp_domain_poll_until_the_counter_fires() -> None:
    """Writes due at once (`expect_soon(imm, at_once=True)`): every domain's worker polls its
    completion queue after activity instead of sleeping on its fd, until the counter fires;
    due merely soon, tcp workers keep sleeping on their fds (arrivals wake them)."""
    with TransferEngine("tcp", num_domains=2) as engine:
        def polls() -> list[bool]:
            return [d._worker.idle_polls(100_000) for d in engine._domains]

        engine.expect_imm_count(9, 2, lambda: None)
        assert engine.expect_soon(9) and polls() == [False, False]
        assert engine.expect_soon(9, at_once=True) and polls() == [True, True]
        engine.imm_counters.on_imm(9, 2)
        assert polls() == [False, False]
