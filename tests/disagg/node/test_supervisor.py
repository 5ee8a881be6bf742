"""Supervision (X5e): a node that dies is started again, with doubling waits, and taken back.

The policy over stand-in processes (a cluster whose nodes exit at once, fast); then a real
supervised cluster (tiny model, tcp on loopback): a decoder, then a prefiller, killed with
SIGKILL, each restarted at its address, the router (or the decoder) reconnects, and a request
after each restart decodes the single-node engine's tokens. No process is left at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg.control.messages import Submit
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.router import Router
from disagg.node.supervisor import NodeWatch, Supervisor
from tests.disagg.node.test_disagg_e2e import single_node_tokens

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28], [3, 4, 5]]
MAX_TOKENS = 6


class DyingCluster:
    """A stand-in cluster: node "n" is a process that exits with code 3 at once."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.deaths: list[float] = []
        self.process = self._start()
        self._stopping = threading.Event()

    def _start(self) -> subprocess.Popen[str]:
        self.starts.append(time.monotonic())
        process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], text=True)
        # Dead before the supervisor sees it: a wait is measured from the death, not from a
        # start whose interpreter a loaded machine may take half a second to run.
        process.wait()
        self.deaths.append(time.monotonic())
        return process

    def process_of(self, name: str) -> subprocess.Popen[str]:
        return self.process

    def restart(self, name: str) -> bool:
        if self._stopping.is_set():
            return False
        self.process = self._start()
        return True

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()


def test_a_node_that_keeps_dying_waits_doubling_up_to_a_cap() -> None:
    """Waits from a death to the next start go 0.05, 0.1, 0.2, 0.2 (the cap); each start
    counts."""
    cluster = DyingCluster()
    supervisor = Supervisor(cluster, ["n"], first_s=0.05, max_s=0.2).start()
    try:
        deadline = time.monotonic() + 10
        while len(cluster.starts) < 5:
            assert time.monotonic() < deadline, cluster.starts
            time.sleep(0.01)
    finally:
        supervisor.stop()
    gaps = [b - a for a, b in zip(cluster.deaths, cluster.starts[1:], strict=False)][:4]
    for gap, wait in zip(gaps, [0.05, 0.1, 0.2, 0.2], strict=True):
        assert wait <= gap < wait + 0.5, gaps
    assert supervisor.restarts("n") >= 4
    assert supervisor.records["n"].last_exit == 3


def test_nothing_is_restarted_once_the_cluster_stops() -> None:
    """A death seen while the cluster is stopping is its stop, not a crash: no restart."""
    cluster = DyingCluster()
    cluster._stopping.set()
    supervisor = Supervisor(cluster, ["n"], first_s=0.01, max_s=0.01).start()
    time.sleep(0.5)
    supervisor.stop()
    assert len(cluster.starts) == 1 and supervisor.restarts("n") == 0
    assert supervisor.records["n"].state is NodeWatch.STOPPED


def test_a_stopped_local_cluster_starts_nothing_again() -> None:
    """Once stop() has begun, `restart` starts no process (the supervisor's race with stop)."""
    cluster = LocalCluster(ClusterConfig.from_options(model="tiny"), supervise=True)
    cluster.stop()
    assert cluster.stopping and cluster.restart("decode-0") is False
    assert cluster.processes == []


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """A supervised prefiller and decoder; at the end every process it ever ran is gone."""
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4,
                                        num_pages=128, chunk_size=32)
    with LocalCluster(config, supervise=True) as started:
        pids = {process.pid for process in started.processes}
        yield started
        pids |= {process.pid for process in started.processes}
    assert started.exit_codes() == [0, 0], started.logs  # the restarted ones shut down clean
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def serve(router: Router, request_id: str, prompt: list[int]) -> list[int]:
    router.route(Submit(request_id, prompt, MAX_TOKENS))
    tokens: list[int] = []
    while True:
        event = router.events.get(timeout=60)
        assert event.request_id == request_id, event
        tokens += event.token_ids
        if event.state.is_terminal():
            assert event.state.value == "finished_length", event
            return tokens


def wait_restarted(cluster: LocalCluster, name: str, restarts: int, router: Router) -> None:
    """Until `name` was restarted `restarts` times and the router takes requests again."""
    deadline = time.monotonic() + 90
    while not (cluster.restart_count(name) >= restarts
               and cluster.supervisor is not None
               and cluster.supervisor.records[name].state is NodeWatch.RUNNING
               and router.takes_requests(0)):
        assert time.monotonic() < deadline, cluster.logs[name][-10:]
        time.sleep(0.05)


@pytest.mark.fabric
@pytest.mark.slow  # two node processes, each restarted once
def test_killed_nodes_are_restarted_and_serve_token_exact(cluster: LocalCluster) -> None:
    """SIGKILL the decoder, then the prefiller: each comes back at its address (restart
    count 1), is taken back, and the next request decodes the single-node tokens."""
    reference = single_node_tokens("tiny", PROMPTS, MAX_TOKENS)
    router = Router(cluster.decoder_addresses)
    try:
        assert serve(router, "before", PROMPTS[0]) == reference[0]
        for step, name in enumerate(["decode-0", "prefill-0"], start=1):
            address = {"decode-0": cluster.decoder_addresses[0],
                       "prefill-0": cluster.prefiller_address}[name]
            old = cluster.process_of(name).pid
            os.kill(old, signal.SIGKILL)
            wait_restarted(cluster, name, 1, router)
            assert cluster.process_of(name).pid != old
            assert any(f"--- {name} started again" in line for line in cluster.logs[name])
            assert address in (cluster.decoder_addresses + cluster.prefiller_addresses)
            assert serve(router, f"after-{name}", PROMPTS[step]) == reference[step]
        assert {name: cluster.restart_count(name) for name in cluster.names} == {
            "prefill-0": 1, "decode-0": 1}
    finally:
        router.close()


@pytest.mark.fabric
@pytest.mark.slow  # a TP 2 decoder: three processes, restarted once
def test_a_node_whose_rank_died_is_restarted_with_new_ranks() -> None:
    """SIGKILL TP rank 1 of a TP 2 decoder: the decoder exits (S3c), the supervisor starts it
    again with new ranks, and it serves the single-node tokens."""
    reference = single_node_tokens("tiny", PROMPTS[:1], MAX_TOKENS)
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4,
                                        num_pages=64, decode_tp=2)
    with LocalCluster(config, supervise=True) as cluster:
        (rank1,) = cluster.rank_pids["decode-0"]
        router = Router(cluster.decoder_addresses)
        try:
            os.kill(rank1, signal.SIGKILL)
            wait_restarted(cluster, "decode-0", 1, router)
            (new_rank1,) = cluster.rank_pids["decode-0"]
            assert new_rank1 != rank1
            assert serve(router, "after-rank", PROMPTS[0]) == reference[0]
        finally:
            router.close()
    assert cluster.exit_codes() == [0, 0], cluster.logs
    assert not Path(f"/proc/{new_rank1}").exists()
