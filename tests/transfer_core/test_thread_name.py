"""OS thread names (`name_current_thread`): what `top -H` and `/proc/PID/task/TID/comm` show
for the transfer core's threads, which per-thread CPU accounting goes by."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from transfer_core.engine import TransferEngine
from transfer_core.poller import CounterPoller
from transfer_core.thread_name import name_current_thread


def os_name(thread: threading.Thread) -> str:
    with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
        return comm.read().strip()


def test_a_thread_names_itself_and_the_os_keeps_15_bytes() -> None:
    named, done, seen = threading.Event(), threading.Event(), []

    def run() -> None:
        seen.append(name_current_thread("a-rather-long-thread-name"))
        named.set()
        done.wait(5)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert named.wait(5)
        assert seen == [True]
        assert os_name(thread) == "a-rather-long-t"
    finally:
        done.set()
        thread.join()


def test_the_poller_thread_carries_its_name() -> None:
    with CounterPoller([torch.zeros(1, dtype=torch.int64)], lambda *_: None,
                       name="kv-poller") as poller:
        assert poller._thread is not None
        assert os_name(poller._thread) == "kv-poller"


@pytest.mark.fabric
def test_each_domain_thread_is_named_by_its_index() -> None:
    with TransferEngine("tcp", num_domains=2) as engine:
        deadline = time.monotonic() + 5.0  # each names itself as it starts
        while (names := sorted(os_name(w.thread) for w in engine._domains)) != [
                "tc-domain-0", "tc-domain-1"] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert names == ["tc-domain-0", "tc-domain-1"]
