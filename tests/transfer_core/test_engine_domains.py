"""Choosing domains, NICs and CPUs of a `TransferEngine` (S5b, S6a): two real engines over
tcp and shm on loopback, in this process.

A 2-domain sender writes to a 2-domain receiver; per-domain stats on both sides show which
domain carried what (local domain d writes to the peer's domain d).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.memory import MemoryRegion, MemoryRegionDescriptor
from transfer_core.pyfabric import find_infos
from transfer_core.transport import PagedWrite

PAGE = 4096
PAGES = 8
Pair = tuple[TransferEngine, TransferEngine, MemoryRegion, MemoryRegionDescriptor, np.ndarray]


def _pair(provider: str) -> Iterator[Pair]:
    with (
        TransferEngine(provider, num_domains=2) as a,
        TransferEngine(provider, num_domains=2) as b,
    ):
        src = np.arange(PAGES * PAGE, dtype=np.uint8)
        dst = np.zeros_like(src)
        src_mr, _ = a.register_memory(src)
        _, dst_desc = b.register_memory(dst)
        yield a, b, src_mr, dst_desc, dst


@pytest.fixture(params=["tcp", "shm"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    yield from _pair(request.param)


@pytest.fixture(scope="module")
def checked() -> Iterator[Pair]:
    """One pair for the argument checks, which never post."""
    yield from _pair("tcp")


def _paged(
    a: TransferEngine,
    src_mr: MemoryRegion,
    dst: MemoryRegionDescriptor,
    domains: list[int] | None = None,
) -> None:
    done = threading.Event()
    pages = np.arange(PAGES)
    a.post_paged_writes(
        PagedWrite(src_mr, pages, PAGE, 0, dst, pages, PAGE, 0, PAGE, 7, domains), done.set
    )
    assert done.wait(10.0), "paged write did not finish"


def _wait_imms(engine: TransferEngine, total: int) -> list[int]:
    reached = threading.Event()
    engine.expect_imm_count(7, total, reached.set)
    assert reached.wait(10.0), "receiver did not count the writes"
    return [s.imms_received for s in engine.stats()]


def test_paged_writes_go_through_the_named_domain_only(pair: Pair) -> None:
    """domains=[1]: every page leaves on our domain 1 and lands on the peer's domain 1."""
    a, b, src_mr, dst_desc, dst = pair
    _paged(a, src_mr, dst_desc, domains=[1])
    assert [s.writes_completed for s in a.stats()] == [0, PAGES]
    assert [s.bytes_written for s in a.stats()] == [0, PAGES * PAGE]
    assert _wait_imms(b, PAGES) == [0, PAGES]
    assert np.array_equal(dst, np.arange(PAGES * PAGE, dtype=np.uint8))


def test_paged_writes_stripe_over_the_named_domains(pair: Pair) -> None:
    """domains=[1, 0] stripes over both, in that order: the first half goes on domain 1."""
    a, b, src_mr, dst_desc, _ = pair
    _paged(a, src_mr, dst_desc, domains=[1, 0])
    assert [s.writes_completed for s in a.stats()] == [PAGES // 2, PAGES // 2]
    assert _wait_imms(b, PAGES) == [PAGES // 2, PAGES // 2]


def test_single_write_and_imm_use_the_named_domain(pair: Pair) -> None:
    """post_write(domain=1) and post_imm(domain=1) both leave on domain 1."""
    a, b, src_mr, dst_desc, _ = pair
    write_done, imm_done = threading.Event(), threading.Event()
    a.post_write(src_mr, 0, PAGE, 7, dst_desc, 0, write_done.set, domain=1)
    a.post_imm(7, dst_desc, imm_done.set, domain=1)
    assert write_done.wait(10.0)
    assert imm_done.wait(10.0)
    assert [s.writes_completed for s in a.stats()] == [0, 2]
    assert _wait_imms(b, 2) == [0, 2]


@pytest.mark.parametrize(
    ("domains", "match"),
    [([2], "domain index 2 is out of range: num_domains=2"), ([-1], "-1 is out of range"),
     ([], "names no domain"), ([0, 0], "twice"), (1, "sequence")],
)  # fmt: skip
def test_bad_domain_indices_are_refused(checked: Pair, domains: object, match: str) -> None:
    """An index outside [0, num_domains) is a ValueError naming it and num_domains."""
    a, _, src_mr, dst_desc, _ = checked
    with pytest.raises(ValueError, match=match):
        _paged(a, src_mr, dst_desc, domains=domains)


def test_bad_single_domain_is_refused(checked: Pair) -> None:
    """post_write and post_imm check their domain index too."""
    a, _, src_mr, dst_desc, _ = checked
    with pytest.raises(ValueError, match="domain index 5 is out of range: num_domains=2"):
        a.post_write(src_mr, 0, PAGE, 7, dst_desc, 0, domain=5)
    with pytest.raises(ValueError, match="domain index 2 is out of range"):
        a.post_imm(7, dst_desc, domain=2)


def _affinity(thread: threading.Thread) -> set[int]:
    assert thread.native_id is not None
    return os.sched_getaffinity(thread.native_id)


def test_domain_cpus_pin_each_progress_thread() -> None:
    """domain_cpus[d] is the affinity of domain d's thread; other threads are untouched."""
    cores = sorted(os.sched_getaffinity(0))
    wanted = [[cores[0]], [cores[-1]]]
    before = os.sched_getaffinity(0)
    with TransferEngine("tcp", num_domains=2, domain_cpus=wanted) as a:
        threads = [w.thread for w in a._domains]
        assert [_affinity(t) for t in threads] == [set(c) for c in wanted]
    assert os.sched_getaffinity(0) == before


def test_cpus_round_robin_still_pins() -> None:
    """The old `cpus` argument pins domain d to cpus[d % len(cpus)]."""
    core = max(os.sched_getaffinity(0))
    with TransferEngine("tcp", num_domains=2, cpus=[core]) as a:
        assert [_affinity(w.thread) for w in a._domains] == [{core}, {core}]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"domain_cpus": [[0]]}, "1 entries for num_domains=2"),
     ({"domain_cpus": [[0], []]}, r"domain_cpus\[1\] names no CPU"),
     ({"domain_cpus": [[0], [4096]]}, r"CPUs \[4096\] are not among"),
     ({"domain_cpus": [[0], [0]], "cpus": [0]}, "not both")],
)  # fmt: skip
def test_bad_domain_cpus_are_refused(kwargs: dict, match: str) -> None:
    """Wrong counts, empty sets and CPUs outside the process are clear errors up front."""
    with pytest.raises(ValueError, match=match):
        TransferEngine("tcp", num_domains=2, **kwargs)


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_nics_pick_domains_by_name(provider: str) -> None:
    """nics=[name]: the domain opens on the fabric domain of that name (prefix match)."""
    name = find_infos(provider)[0].domain_name
    with TransferEngine(provider, num_domains=2, nics=[name, None]) as a:
        assert [w.info.domain_name for w in a._domains] == [name, name]


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_unknown_nic_lists_the_offered_domains(provider: str) -> None:
    """A name no domain has is a ValueError listing what fi_getinfo offers."""
    name = find_infos(provider)[0].domain_name
    with pytest.raises(ValueError, match=rf"'mlx5_9'.*offers \['{name}'\]"):
        TransferEngine(provider, nics=["mlx5_9"])
