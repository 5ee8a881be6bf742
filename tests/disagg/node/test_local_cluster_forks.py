"""A local cluster's processes come from its fork server (X5f): real nodes (tiny model, tcp on
loopback), a TP 2 decoder among them, and what a dead server means for restarts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from disagg.errors import DisaggError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from disagg.node.log_level import LOG_LEVEL_ENV
from disagg.node.supervisor import NodeWatch
from tests.process_stat import parent_of

pytestmark = pytest.mark.fabric

CONFIG = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, num_pages=64,
                                    chunk_size=32, decode_tp=2)


@pytest.mark.slow  # three processes, each started twice
def test_nodes_and_ranks_are_forked_and_a_dead_server_is_replaced() -> None:
    """Every node and the decoder's rank are the fork server's children; with that server
    killed (its children get SIGTERM), each node comes back from a new one."""
    with LocalCluster(CONFIG, supervise=True) as cluster:
        pids = [process.pid for process in cluster.processes] + cluster.rank_pids["decode-0"]
        servers = {parent_of(pid) for pid in pids}
        assert len(servers) == 1 and os.getpid() not in servers
        [server] = servers
        os.kill(server, signal.SIGKILL)
        for name in cluster.names:
            cluster.process_of(name).wait(timeout=30)
        deadline = time.monotonic() + 120
        for name in cluster.names:
            while not (cluster.restart_count(name) >= 1 and cluster.supervisor is not None
                       and cluster.supervisor.records[name].state is NodeWatch.RUNNING):
                assert time.monotonic() < deadline, cluster.logs[name][-10:]
                time.sleep(0.05)
        new = {parent_of(process.pid) for process in cluster.processes}
        assert len(new) == 1 and not new & {server, os.getpid()}
    assert all(code is not None for code in cluster.exit_codes())


def test_a_forked_node_that_stops_at_once_is_named_with_its_code_and_words(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its exit code comes from the server and its stderr from its own pipe: a node that
    rejects the environment it inherited (an unknown log level) fails the cluster's start
    with both, and nothing is left running."""
    monkeypatch.setenv(LOG_LEVEL_ENV, "chatty")
    cluster = LocalCluster(CONFIG)
    with pytest.raises(DisaggError, match=r"prefill-0 did not start \(exit code 2\).*chatty"):
        cluster.__enter__()
    assert cluster.exit_codes() == [2]
