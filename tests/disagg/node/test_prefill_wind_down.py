"""A prefiller asked to shut down with work in flight ends that work, then is clean (X5).

The Shutdown can arrive while a decoder's request is still being prefilled and streamed (the
decoder asked just before, or left without the prefiller noticing yet). `wind_down` fails what
is in flight and lets its writes finish, so the node's leak check proves the teardown freed
everything instead of failing on the timing of the Shutdown.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from disagg.config import CacheConfig, SchedulerConfig
from disagg.control.messages import Submit
from disagg.node.builder import build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefill_node import PrefillNode
from disagg.node.router import Router

pytestmark = pytest.mark.fabric

CACHE = CacheConfig(page_size=4, num_pages=256)


def _nodes() -> tuple[PrefillNode, DecodeNode]:
    prefill = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(
        chunk_size=2, max_num_batched_tokens=2, mode="prefill_only"), role=NodeRole.PREFILL))
    decode = build_node(NodeConfig("tiny", CACHE, SchedulerConfig(), role=NodeRole.DECODE,
                                   prefillers=(prefill.address,)))
    assert isinstance(prefill, PrefillNode) and isinstance(decode, DecodeNode)
    return prefill, decode


def _stop_mid_prefill(prefill: PrefillNode, decode: DecodeNode) -> tuple[Router, threading.Thread]:
    """Run both; stop the prefiller's loop while a long prompt is still in flight there (the
    decoder keeps running and waiting for its KV). Returns the decoder's router and loop thread."""
    threads = [threading.Thread(target=node.run, daemon=True) for node in (prefill, decode)]
    for thread in threads:
        thread.start()
    router = Router([decode.address])
    router.route(Submit("long", list(range(3, 203)), 4))  # 100 two-token chunks
    deadline = time.monotonic() + 30
    while not prefill.messenger.has_work() and time.monotonic() < deadline:
        time.sleep(0.001)
    prefill.stop()
    threads[0].join(10)
    assert prefill.messenger.has_work(), "the prompt was prefilled before the stop"
    return router, threads[1]


def test_wind_down_ends_in_flight_work_and_leaves_the_prefiller_clean() -> None:
    prefill, decode = _nodes()
    router, decode_thread = None, None
    try:
        router, decode_thread = _stop_mid_prefill(prefill, decode)
        prefill.wind_down()
        prefill.check_clean()
        assert prefill.messenger.stats["failed"] == 1  # ended, not prefilled to the end
    finally:
        if router is not None:
            router.close()
        decode.stop()
        if decode_thread is not None:
            decode_thread.join(10)
        decode.close()
        prefill.close()


class _Messenger:
    """Writes in flight that complete after `polls` polls (None: never)."""

    def __init__(self, polls: int | None) -> None:
        self.polls_left, self.polled, self.failed = polls, 0, False

    def has_work(self) -> bool:
        return self.polls_left is None or self.polled < self.polls_left

    def poll(self) -> None:
        self.polled += 1

    def fail_all(self, reason: str) -> None:
        self.failed = True


def test_settle_polls_until_the_writes_in_flight_complete_and_fails_nothing() -> None:
    """What `settle` gives `check_clean`: the completions still on their way, reaped."""
    node = SimpleNamespace(messenger=_Messenger(polls=3))
    PrefillNode.settle(node, timeout_s=5.0)  # type: ignore[arg-type]
    assert not node.messenger.has_work() and node.messenger.polled == 3
    assert not node.messenger.failed


def test_settle_gives_up_on_writes_that_never_complete() -> None:
    """A transfer stuck for good is left for `check_clean` to report, not failed here."""
    node = SimpleNamespace(messenger=_Messenger(polls=None))
    PrefillNode.settle(node, timeout_s=0.1)  # type: ignore[arg-type]
    assert node.messenger.has_work() and not node.messenger.failed
