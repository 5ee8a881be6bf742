"""`Transport` (S5, S4c): every engine offers each member of the protocol with the protocol's
own signature, and `PagedWrite` checks a paged write when it is made.

The protocol is what messengers are written against; an engine that drifted from it (a
renamed parameter, another default, a missing counter method) would let messenger unit tests
over the loopback pass while a node over the real engine fails, or the reverse.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from transfer_core.engine import TransferEngine
from transfer_core.errors import BoundsError
from transfer_core.faults import FaultPlan, FaultyTransport
from transfer_core.testing.loopback import LoopbackEngine, LoopbackFabric
from transfer_core.transport import PagedWrite, Transport

PAGE = 64
ENGINES: dict[str, Callable[[], Any]] = {
    "tcp": lambda: TransferEngine("tcp"),
    "loopback": lambda: LoopbackEngine(fabric=LoopbackFabric()),
    "faulty-tcp": lambda: FaultyTransport(TransferEngine("tcp"), FaultPlan()),
    "faulty-loopback": lambda: FaultyTransport(
        LoopbackEngine(fabric=LoopbackFabric()), FaultPlan()
    ),
}


def protocol_members() -> dict[str, Any]:
    """Name -> the protocol's own definition (function, property, or its annotation)."""
    members = {n: v for n, v in vars(Transport).items() if not n.startswith("_")}
    members.update(Transport.__annotations__)
    return members


def _signature(function: Any) -> list[tuple[str, Any, Any, Any]]:
    """(name, kind, default, annotation text) of each parameter, and the return annotation."""
    signature = inspect.signature(function)
    params = [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()]
    return [*params, ("->", None, None, signature.return_annotation)]


@pytest.fixture(params=list(ENGINES), scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[Any]:
    with ENGINES[request.param]() as made:
        yield made


def test_the_protocol_names_what_messengers_use() -> None:
    """The members, by side: a change here is a change of every engine's surface."""
    assert sorted(protocol_members()) == sorted(
        [
            "timeout_s",
            "provider",
            "num_domains",
            "supports_hmem",
            "memory_path",
            "address",
            "register_memory",
            "unregister_memory",
            "connect",
            "post_write",
            "post_paged_writes",
            "post_imm",
            "write_and_wait",
            "abandon_peer",
            "expect_imm_count",
            "expect_soon",
            "remove_imm_count",
            "pending_imm_counts",
            "imm_counted",
            "dropped_imms",
            "tap_imms",
            "stats",
            "close",
        ]
    )


def test_every_member_exists_with_the_protocols_signature(engine: Any) -> None:
    """Methods: same parameter names, kinds, defaults and annotations, and no *args/**kwargs;
    properties and attributes: present on the engine."""
    assert isinstance(engine, Transport)
    wrong = []
    for name, member in protocol_members().items():
        if not hasattr(engine, name):
            wrong.append(f"{name}: missing")
        elif inspect.isfunction(member):
            ours = inspect.getattr_static(type(engine), name)
            if _signature(ours) != _signature(member):
                wrong.append(f"{name}{inspect.signature(ours)} != {inspect.signature(member)}")
            kinds = {p.kind for p in inspect.signature(ours).parameters.values()}
            if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
                wrong.append(f"{name}: a *args/**kwargs pass-through")
    assert not wrong, "\n".join(wrong)


def _regions(engine: Any, pages: int = 4) -> tuple[Any, Any]:
    src, _ = engine.register_memory(np.ones(pages * PAGE, np.uint8), name="src")
    _, dst = engine.register_memory(np.zeros(pages * PAGE, np.uint8), name="dst")
    return src, dst


def test_paged_write_keeps_page_ids_as_int64_arrays() -> None:
    """Lists become flat int64 arrays (what the C data path reads); the byte offsets are
    offset + id * stride."""
    with LoopbackEngine(fabric=LoopbackFabric()) as engine:
        src, dst = _regions(engine)
        write = PagedWrite(src, [3, 1], PAGE, 0, dst, [[0], [2]], PAGE, 8, 32, 7)
        assert isinstance(write.src_page_ids, np.ndarray)
        assert write.src_page_ids.dtype == np.int64
        assert write.dst_page_ids.tolist() == [0, 2]
        assert write.num_pages == 2
        assert write.src_byte_offsets().tolist() == [3 * PAGE, PAGE]
        assert write.dst_byte_offsets().tolist() == [8, 2 * PAGE + 8]


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"src_page_ids": [0, 4]}, BoundsError, "region 'src'"),
        ({"dst_offset": PAGE}, BoundsError, "region 'dst'"),
        ({"dst_page_ids": [0]}, ValueError, "2 source pages but 1 destination pages"),
        ({"src_page_ids": []}, ValueError, "src_page_ids: no pages"),
        ({"nbytes": 0}, ValueError, "nbytes and page strides must be > 0"),
        ({"imms": [1, 2]}, ValueError, "imm \\(every page\\) or imms \\(per page\\)"),
        ({"imm": None, "imms": [1]}, ValueError, "imms has 1 values for 2 pages"),
        ({"imm": None, "imms": [1, -1]}, ValueError, "imms must fit in 32 bits"),
        ({"imm": None, "imms": [1, 2**32]}, ValueError, "imms must fit in 32 bits"),
        ({"imm": None, "imms": [1.0, 2.0]}, TypeError, "imms must be integers"),
    ],
)
def test_paged_write_is_checked_when_made(change: dict[str, Any], error: type, match: str) -> None:
    """Out-of-bounds pages name their region; mismatched or empty lists are refused."""
    with LoopbackEngine(fabric=LoopbackFabric()) as engine:
        src, dst = _regions(engine)
        fields = {
            "src_mr": src,
            "src_page_ids": [0, 1],
            "src_page_stride": PAGE,
            "src_offset": 0,
            "dst_mr": dst,
            "dst_page_ids": [2, 3],
            "dst_page_stride": PAGE,
            "dst_offset": 0,
            "nbytes": PAGE,
            "imm": 1,
        }
        with pytest.raises(error, match=match):
            PagedWrite(**{**fields, **change})
