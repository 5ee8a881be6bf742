"""A forked node used as a `Popen` (X5f): a real fork server and its children. The children
run a node's entry point; a config that is not JSON stops them at once with the CLI's
user-error code, and one that never comes keeps them waiting on stdin, so no model is built
except in the last test, a real local cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator

import pytest

from disagg.errors import DisaggError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.forked_process import ForkServer
from disagg.node.local_cluster import LocalCluster
from disagg.node.supervisor import NodeWatch


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    server = ForkServer(dict(os.environ))
    yield server
    server.close()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_a_node_reads_its_stdin_and_its_exit_code_comes_back(forks: ForkServer) -> None:
    process = forks.start()
    assert parent_of(process.pid) == forks.pid
    assert process.stdin is not None and process.stderr is not None
    process.stdin.write("{not json")
    process.stdin.close()
    assert process.wait(timeout=30) == 2 == process.returncode
    assert "error: node config" in process.stderr.read()


def test_a_killed_node_reports_minus_its_signal(forks: ForkServer) -> None:
    process = forks.start()
    assert process.poll() is None
    process.kill()
    assert process.wait(timeout=10) == -signal.SIGKILL
    process.kill()  # ended: nothing is sent to a pid that may be another's by now


def test_a_wait_that_runs_out_raises_as_popens_does(forks: ForkServer) -> None:
    process = forks.start()
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    process.kill()
    assert process.wait(timeout=10) == -signal.SIGKILL


def test_closing_the_server_ends_its_nodes() -> None:
    """They get SIGTERM when it dies, and count as ended by it once they are gone."""
    server = ForkServer(dict(os.environ))
    process = server.start()
    server.close()
    assert not server.alive
    assert process.wait(timeout=10) == -signal.SIGTERM


def test_a_server_that_cannot_start_is_named() -> None:
    with pytest.raises(DisaggError, match="fork server did not start"):
        ForkServer(dict(os.environ, PYTHONHOME="/nonexistent"))


@pytest.mark.fabric
@pytest.mark.slow  # two node processes, one of them started twice
def test_a_clusters_nodes_are_forked_and_a_dead_server_is_replaced() -> None:
    """Each node is the fork server's child; with that server killed, a restarted node comes
    from a new one."""
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4,
                                        num_pages=64, chunk_size=32)
    with LocalCluster(config, supervise=True) as cluster:
        servers = {parent_of(process.pid) for process in cluster.processes}
        assert len(servers) == 1 and os.getpid() not in servers
        [server] = servers
        os.kill(server, signal.SIGKILL)  # its nodes get SIGTERM and die with it
        for name in cluster.names:
            cluster.process_of(name).wait(timeout=30)
        deadline = time.monotonic() + 90
        for name in cluster.names:
            while not (cluster.restart_count(name) >= 1 and cluster.supervisor is not None
                       and cluster.supervisor.records[name].state is NodeWatch.RUNNING):
                assert time.monotonic() < deadline, cluster.logs[name][-10:]
                time.sleep(0.05)
            assert parent_of(cluster.process_of(name).pid) not in (server, os.getpid())
