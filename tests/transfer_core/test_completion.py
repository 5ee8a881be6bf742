"""A striped transfer ends once, after every part has (S5): `Completion` and the router.

A failed part's error waits for the other parts: until they end the provider may still read
the source, which a caller frees on hearing of the end. A domain that refuses its stripe after
others were queued is such a failed part, not a raise.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from transfer_core.completion import Completion
from transfer_core.engine import TransferEngine
from transfer_core.errors import TransferError
from transfer_core.transport import PagedWrite

PAGE = 4096


def _recorder() -> tuple[list[object], Completion]:
    calls: list[object] = []
    done = Completion(3, lambda: calls.append("done"), calls.append, calls.append)
    return calls, done


def test_an_error_waits_for_the_other_parts_and_is_reported_once() -> None:
    calls, done = _recorder()
    first, second = TransferError("first"), TransferError("second")
    done.part_finished(first)
    done.part_finished(second)
    assert calls == []  # a part is still in flight
    done.part_finished(None)
    assert calls == [first]


def test_every_part_done_is_one_on_done() -> None:
    calls, done = _recorder()
    for _ in range(3):
        done.part_finished(None)
    assert calls == ["done"]


def test_a_domain_refusing_a_later_stripe_fails_the_write_once_after_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two domains: the second refuses its stripe. The first stripe's pages still land, the
    call does not raise, and on_error hears the refusal once; a first stripe refused raises."""
    with TransferEngine("tcp", num_domains=2) as a, TransferEngine("tcp") as b:
        src = np.arange(4 * PAGE, dtype=np.uint32).view(np.uint8)[: 4 * PAGE].copy()
        dst = np.zeros_like(src)
        src_mr, _ = a.register_memory(src, remote_write=False)
        _, dst_desc = b.register_memory(dst)
        workers = a._router._domains
        refusal = TransferError("domain 1 is closed")

        def refuse(*_: object) -> None:
            raise refusal

        monkeypatch.setattr(workers[1], "submit", refuse)
        errors: list[BaseException] = []
        ended, landed = threading.Event(), threading.Event()
        b.expect_imm_count(3, 2, landed.set)  # the first stripe's two pages
        write = PagedWrite(src_mr, np.arange(4), PAGE, 0, dst_desc, np.arange(4), PAGE, 0, PAGE, 3)
        a.post_paged_writes(write, on_done=lambda: errors.append("done"),
                            on_error=lambda e: (errors.append(e), ended.set()))
        assert ended.wait(10.0) and landed.wait(10.0)
        assert errors == [refusal]
        assert np.array_equal(dst[: 2 * PAGE], src[: 2 * PAGE])  # domain 0's stripe landed
        monkeypatch.setattr(workers[0], "submit", refuse)
        with pytest.raises(TransferError, match="domain 1 is closed"):
            a.post_paged_writes(write)
