"""A TP node whose rank dies fails as a whole, cleanly (S3c): real node and rank processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from disagg.node.local_cluster import ClusterConfig, LocalCluster

pytestmark = [pytest.mark.fabric, pytest.mark.slow]


def wait_exit(cluster: LocalCluster, name: str, timeout_s: float = 20.0) -> int | None:
    process = cluster.processes[cluster.names.index(name)]
    deadline = time.monotonic() + timeout_s
    while process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return process.poll()


def test_a_killed_rank_ends_its_node_and_every_other_rank() -> None:
    """SIGKILL rank 1 of a TP 2 decoder: the decoder exits non-zero naming the rank, its other
    processes are gone, and the prefiller is untouched."""
    config = ClusterConfig(model="tiny", num_decoders=1, page_size=4, num_pages=64,
                           prefill_tp=2, decode_tp=2)
    with LocalCluster(config) as cluster:
        decoder_pid = cluster.processes[cluster.names.index("decode-0")].pid
        (rank1,) = cluster.rank_pids["decode-0"]
        os.kill(rank1, signal.SIGKILL)
        code = wait_exit(cluster, "decode-0")
        assert code not in (None, 0)
        time.sleep(0.2)  # the stderr reader
        assert any("TP rank 1 of decode-0" in line and "killed by signal 9" in line
                   for line in cluster.logs["decode-0"]), cluster.logs["decode-0"][-5:]
        assert not Path(f"/proc/{decoder_pid}").exists() or code is not None
        assert not Path(f"/proc/{rank1}").exists()
        assert cluster.exit_codes()[cluster.names.index("prefill-0")] is None
