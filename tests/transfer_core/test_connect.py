"""`TransferEngine.connect`: the peer's connection opened at handshake, counting nothing (S5).

A warm-up is a zero-byte write without immediate into the peer's probe region (warmup.py). The
peer must count nothing (a decoder counts a request's immediates: a stray one would corrupt
it), no byte of its memory may change, a second warm-up posts nothing, the next real write is
counted exactly once, and a bad or gone peer raises a TransferError instead of hanging. No
timing is asserted here: benchmarks/first_write.py measures what warming saves.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import DescriptorError, PeerError, TransferError
from transfer_core.memory import EngineAddress

PAGE = 4096
Engines = tuple[TransferEngine, TransferEngine]


@pytest.fixture(params=["tcp", "shm"])
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    a, b = TransferEngine(request.param, num_domains=2), TransferEngine(request.param)
    yield a, b
    a.close()
    b.close()


def _posted(engine: TransferEngine) -> list[int]:
    return [s.writes_posted for s in engine.stats()]


def test_address_carries_one_probe_per_domain(engines: Engines) -> None:
    """Each domain publishes the (key, raddr) of its probe region."""
    a, _ = engines
    address = EngineAddress.from_bytes(a.address)
    assert len(address.probes) == len(address.domains) == 2


def test_warm_up_counts_nothing_and_is_idempotent(engines: Engines) -> None:
    """After connect() the peer has counted nothing and its memory is unchanged; connecting
    again posts no write; the next real write with an immediate is counted exactly once."""
    a, b = engines
    src_mr, _ = a.register_memory(np.full(PAGE, 7, np.uint8))
    dst = np.zeros(PAGE, np.uint8)
    _, desc = b.register_memory(dst)
    a.connect(b.address)
    assert _posted(a) == [1, 1]  # one zero-byte write per domain of ours
    a.connect(b.address)
    assert _posted(a) == [1, 1]
    stats = b.stats()[0]
    assert (stats.imms_received, stats.foreign_errors) == (0, 0)
    assert b.pending_imm_counts() == {}
    assert [b.imm_counted(imm) for imm in (0, 1, 2**32 - 1)] == [0, 0, 0]
    assert not dst.any()

    fired: list[int] = []
    reached = threading.Event()
    b.expect_imm_count(0, 1, lambda: (fired.append(1), reached.set()))
    a.post_write(src_mr, 0, PAGE, 0, desc, 0)
    assert reached.wait(10.0)
    threading.Event().wait(0.05)  # a second firing or a stray count would show by now
    assert (fired, b.imm_counted(0), b.pending_imm_counts()) == ([1], 0, {})
    assert (dst == 7).all()


def test_garbage_and_foreign_addresses_are_refused(engines: Engines) -> None:
    """Bytes that are no engine address, or one of another provider, raise at once."""
    a, b = engines
    with pytest.raises(DescriptorError, match="magic"):
        a.connect(b"not an engine address")
    with pytest.raises(DescriptorError):
        a.connect(b.address[:-3])
    foreign = EngineAddress("other", (b"x",), ((1, 0),)).to_bytes()
    with pytest.raises(ValueError, match="provider"):
        a.connect(foreign)
    bare = EngineAddress(a.provider, EngineAddress.from_bytes(b.address).domains).to_bytes()
    with pytest.raises(PeerError, match="warm-up region"):
        a.connect(bare)


@pytest.mark.slow  # waits out the provider's connect timeout: about 2 s
def test_gone_peer_raises_a_transfer_error(engines: Engines) -> None:
    """A peer that closed: shm knows at once (PeerError), tcp gives up at the timeout; twice,
    since a failed warm-up is not remembered as done."""
    a, _ = engines
    c = TransferEngine(a.provider.split(";")[0])
    gone = c.address
    c.close()
    for _ in range(2):
        with pytest.raises(TransferError, match="warming up"):
            a.connect(gone, timeout_s=1.0)


def test_connect_from_a_callback_is_refused(engines: Engines) -> None:
    """connect() blocks; on the engine's own thread it would wait for itself."""
    a, b = engines
    _, desc = b.register_memory(np.zeros(PAGE, np.uint8))
    caught: list[BaseException] = []
    ran = threading.Event()

    def inside() -> None:
        try:
            a.connect(b.address)
        except RuntimeError as exc:
            caught.append(exc)
        ran.set()

    a.post_imm(1, desc, inside)
    assert ran.wait(10.0)
    assert "own callback thread" in str(caught[0])
