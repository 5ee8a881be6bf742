"""`LoopbackEngine`: the in-process test double of `TransferEngine` (S5, S4c).

What the contract test (test_loopback_contract.py) cannot show, because the real engine has no
such thing: inline delivery, the hold/release and drop_imm hooks, the fabric registry, and the
failure paths a test double must still get right (gone peer, stale key, close with writes in
flight, a raising callback).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from transfer_core.errors import DescriptorError, PeerError, ProviderNotFoundError, TransferError
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor
from transfer_core.staging import open_engine, register_kv
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric
from transfer_core.transport import PagedWrite, PageIds

PAGE = 256
Pair = tuple[LoopbackEngine, LoopbackEngine]


@pytest.fixture(params=[False, True], ids=["threaded", "inline"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    fabric = LoopbackFabric()
    a = LoopbackEngine(fabric=fabric, deliver_inline=request.param)
    b = LoopbackEngine(fabric=fabric, deliver_inline=request.param)
    yield a, b
    a.close()
    b.close()


def _regions(a: LoopbackEngine, b: LoopbackEngine, pages: int = 8) -> tuple:
    src = np.arange(pages * PAGE, dtype=np.uint32).view(np.uint8)[: pages * PAGE].copy()
    dst = np.zeros(pages * PAGE, np.uint8)
    smr, _ = a.register_memory(src, name="src")
    _, desc = b.register_memory(dst, name="dst")
    return src.reshape(pages, PAGE), dst.reshape(pages, PAGE), smr, desc


def _pages(smr: MemoryRegion, src: PageIds, desc: MemoryRegionDescriptor, dst: PageIds,
           imm: int, domains: list[int] | None = None) -> PagedWrite:
    return PagedWrite(smr, src, PAGE, 0, desc, dst, PAGE, 0, PAGE, imm, domains)


def _settle(*engines: LoopbackEngine) -> None:
    assert engines[0].fabric.quiesce(10.0)


def test_identity_and_wire_formats() -> None:
    """Unique addresses that parse as EngineAddress; descriptors round-trip through bytes."""
    fabric = LoopbackFabric()
    with LoopbackEngine(fabric=fabric, num_domains=2) as a, LoopbackEngine(fabric=fabric) as b:
        assert (a.provider, a.supports_hmem, a.num_domains, a.memory_path) == (
            "loopback", False, 2, "auto"
        )
        assert a.address != b.address
        assert len(EngineAddress.from_bytes(a.address).domains) == 2
        _, desc = a.register_memory(bytearray(PAGE))
        assert MemoryRegionDescriptor.from_bytes(desc.to_bytes()) == desc
        endpoints = EngineAddress.from_bytes(a.address).domains
        assert tuple(addr for addr, _ in desc.domains) == endpoints


def test_inline_delivery_is_synchronous() -> None:
    """deliver_inline: by the time submit returns, bytes landed, the counter fired and
    on_done ran, all in the caller's thread."""
    fabric = LoopbackFabric()
    with LoopbackEngine(fabric=fabric, deliver_inline=True) as a, \
            LoopbackEngine(fabric=fabric, deliver_inline=True) as b:  # fmt: skip
        src, dst, smr, desc = _regions(a, b)
        seen: list[str] = []
        b.expect_imm_count(3, 4, lambda: seen.append(threading.current_thread().name))
        write = _pages(smr, [0, 1, 2, 3], desc, [7, 5, 3, 1], 3)
        a.post_paged_writes(write, lambda: seen.append("done"))
        assert seen == [threading.current_thread().name, "done"]
        assert (dst[[7, 5, 3, 1]] == src[:4]).all()


def test_threaded_callbacks_run_on_delivery_threads(pair: Pair) -> None:
    """on_done on the sender's thread, the counter on the receiver's (inline: the caller's)."""
    a, b = pair
    _, _, smr, desc = _regions(a, b)
    names: dict[str, str] = {}
    b.expect_imm_count(1, 1, lambda: names.setdefault("reached", threading.current_thread().name))
    a.post_write(smr, 0, PAGE, 1, desc, 0,
                   lambda: names.setdefault("done", threading.current_thread().name))  # fmt: skip
    _settle(a, b)
    if a.deliver_inline:
        assert set(names.values()) == {threading.current_thread().name}
    else:
        assert names["done"] == a.delivery.thread.name
        assert names["reached"] == b.delivery.thread.name


def test_hold_keeps_writes_in_flight(pair: Pair) -> None:
    """Between hold() and release() nothing lands, nothing is counted, on_done waits."""
    a, b = pair
    src, dst, smr, desc = _regions(a, b)
    done = threading.Event()
    a.hold()
    a.post_paged_writes(_pages(smr, [0, 1], desc, [4, 6], 8), done.set)
    _settle(a, b)
    assert (a.held_writes(), b.imm_counted(8), done.is_set(), dst.any()) == (1, 0, False, False)
    assert a.stats()[0].inflight == 2
    a.release()
    _settle(a, b)
    assert (a.held_writes(), b.imm_counted(8), done.is_set()) == (0, 2, True)
    assert (dst[[4, 6]] == src[:2]).all()


def test_drop_imm_loses_immediates_not_bytes(pair: Pair) -> None:
    """A dropped immediate is not counted, but its write's bytes land."""
    a, b = pair
    src, dst, smr, desc = _regions(a, b)
    b.drop_imm(lambda imm: imm == 5)
    a.post_paged_writes(_pages(smr, [0, 1, 2], desc, [0, 1, 2], 5))
    a.post_imm(6, desc)
    _settle(a, b)
    assert (b.imm_counted(5), b.imm_counted(6), b.dropped_imms) == (0, 1, 3)
    assert (dst[:3] == src[:3]).all()
    b.drop_imm(None)
    a.post_imm(5, desc)
    _settle(a, b)
    assert b.imm_counted(5) == 1


def test_raising_callback_resurfaces_on_next_call(pair: Pair) -> None:
    """As the real engine: the exception of on_done is raised by the owner's next call."""
    a, b = pair
    _, _, _, desc = _regions(a, b)

    def boom() -> None:
        raise RuntimeError("boom")

    a.post_imm(1, desc, boom)
    _settle(a, b)
    with pytest.raises(RuntimeError, match="boom"):
        a.post_imm(2, desc)


def test_gone_peer_and_stale_key_fail_through_on_error(pair: Pair) -> None:
    """A closed peer or an unregistered region: on_error gets a PeerError, once."""
    a, b = pair
    _, _, smr, desc = _regions(a, b)
    b.unregister_memory(b.regions.lookup(desc.domains[0][1]))
    errors: list[BaseException] = []
    a.post_write(smr, 0, PAGE, 1, desc, 0, on_error=errors.append)
    fabric = a.fabric
    c = LoopbackEngine(fabric=fabric, deliver_inline=a.deliver_inline)
    _, gone = c.register_memory(np.zeros(PAGE, np.uint8))
    c.close()
    a.post_imm(1, gone, on_error=errors.append)
    _settle(a)
    assert [type(e) for e in errors] == [PeerError, PeerError]
    assert "not a writable region" in str(errors[0])
    assert "unreachable" in str(errors[1])


def test_region_without_remote_write_lands_nothing(pair: Pair) -> None:
    """As on tcp and shm: a write into a region registered with remote_write=False, by a peer
    holding its real key, completes at the sender and lands no byte and no immediate. Keys
    are random, not 1, 2, 3."""
    a, b = pair
    _, _, smr, _ = _regions(a, b)
    source = np.zeros(PAGE, np.uint8)
    _, desc = b.register_memory(source, remote_write=False)
    assert not desc.writable and desc.domains[0][1] > 2**32
    done = threading.Event()
    a.post_write(smr, 0, PAGE, 4, dataclasses.replace(desc, writable=True), 0, done.set)
    _settle(a, b)
    assert done.is_set() and (b.imm_counted(4), int(source.max())) == (0, 0)


def test_forged_descriptor_writes_nothing_outside(pair: Pair) -> None:
    """A descriptor claiming more bytes than the peer registered is refused by the 'NIC'."""
    a, b = pair
    _, dst, smr, desc = _regions(a, b, pages=2)
    big = dataclasses.replace(desc, length=4 * PAGE)
    errors: list[BaseException] = []
    a.post_write(smr, 0, PAGE, 1, big, 3 * PAGE, on_error=errors.append)
    _settle(a, b)
    assert [type(e) for e in errors] == [PeerError]
    assert b.imm_counted(1) == 0
    assert not dst.any()


def test_close_fails_held_writes_and_refuses_work(pair: Pair) -> None:
    """close() fails parked writes through on_error, then refuses every call; idempotent."""
    a, b = pair
    _, _, smr, desc = _regions(a, b)
    a.hold()
    errors: list[BaseException] = []
    a.post_write(smr, 0, PAGE, 1, desc, 0, on_error=errors.append)
    a.close(drain_s=0.1)
    a.close()
    assert len(errors) == 1
    assert "closed" in str(errors[0])
    with pytest.raises(TransferError, match="closed"):
        a.post_imm(1, desc)
    assert b.imm_counted(1) == 0


def test_close_from_callback_is_refused() -> None:
    """As the real engine: closing from its own thread raises instead of joining itself."""
    fabric = LoopbackFabric()
    with LoopbackEngine(fabric=fabric) as a:
        _, desc = a.register_memory(np.zeros(PAGE, np.uint8))
        caught: list[BaseException] = []

        def close_inside() -> None:
            try:
                a.close()
            except RuntimeError as exc:
                caught.append(exc)

        a.post_imm(1, desc, close_inside)
        assert fabric.quiesce(10.0)
        assert "callback thread" in str(caught[0])


def test_connect_checks_the_peer_and_counts_nothing(pair: Pair) -> None:
    """connect() to a live peer counts nothing; garbage and gone peers raise at once."""
    a, b = pair
    a.connect(b.address)
    a.connect(b.address)
    assert (b.pending_imm_counts(), b.stats()[0].imms_received) == ({}, 0)
    with pytest.raises(DescriptorError):
        a.connect(b"garbage")
    c = LoopbackEngine(fabric=a.fabric)
    gone = c.address
    c.close()
    with pytest.raises(PeerError, match="no loopback engine"):
        a.connect(gone)


def test_fits_the_real_engines_factories() -> None:
    """open_engine falls back from hmem like a real provider would; register_kv registers a
    CPU KV tensor on the host path (it reads memory_path and supports_hmem)."""
    with pytest.raises(ProviderNotFoundError):
        LoopbackEngine(hmem=True)
    fabric = LoopbackFabric()
    with open_engine(lambda hmem: LoopbackEngine(hmem=hmem, fabric=fabric), True) as engine:
        kv = register_kv(engine, torch.zeros(2, 4, 8), "kv")
        assert kv.path.kind == "host"
        assert kv.descriptor.length == 2 * 4 * 8 * 4


def test_named_domains_carry_the_writes() -> None:
    """domains=[1] / domain=1 post on domain 1 only, which lands on the peer's domain 1."""
    fabric = LoopbackFabric()
    with (
        LoopbackEngine(fabric=fabric, num_domains=2) as a,
        LoopbackEngine(fabric=fabric, num_domains=2) as b,
    ):
        _, _, smr, desc = _regions(a, b)
        pages = np.arange(8)
        a.post_paged_writes(_pages(smr, pages, desc, pages, 4, domains=[1]))
        a.post_write(smr, 0, PAGE, 4, desc, 0, domain=1)
        a.post_imm(4, desc, domain=1)
        _settle(a, b)
        assert [s.writes_completed for s in a.stats()] == [0, 10]
        assert [s.bytes_written for s in a.stats()] == [0, 9 * PAGE]
        assert [s.imms_received for s in b.stats()] == [0, 10]
        with pytest.raises(ValueError, match="domain index 2 is out of range: num_domains=2"):
            a.post_paged_writes(_pages(smr, pages, desc, pages, 4, domains=[2]))
        with pytest.raises(ValueError, match="domain index 3 is out of range"):
            a.post_imm(4, desc, domain=3)


def test_write_and_wait_lands_before_it_returns(pair: Pair) -> None:
    """As the real engine's: the bytes are placed and counted when it returns."""
    a, b = pair
    src, dst, smr, desc = _regions(a, b)
    a.write_and_wait(smr, PAGE, PAGE, 6, desc, 0)
    _settle(a, b)
    assert np.array_equal(dst[0], src[1])
    assert b.imm_counted(6) == 1
