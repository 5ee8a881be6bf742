"""A TP node whose rank dies fails as a whole, cleanly (S3c): real node and rank processes."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from disagg.node.cluster_config import ClusterConfig
from disagg.node.local_cluster import LocalCluster
from tests.process_stat import ended_within

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
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, num_pages=64,
                                        prefill_tp=2, decode_tp=2)
    with LocalCluster(config) as cluster:
        decoder_pid = cluster.processes[cluster.names.index("decode-0")].pid
        (rank1,) = cluster.rank_pids["decode-0"]
        os.kill(rank1, signal.SIGKILL)
        code = wait_exit(cluster, "decode-0")
        assert code not in (None, 0)
        logs = cluster.logs["decode-0"]
        deadline = time.monotonic() + 5  # the stderr reader thread may still be reading
        while not any("TP rank 1 of decode-0" in line and "killed by signal 9" in line
                      for line in logs):
            assert time.monotonic() < deadline, logs[-5:]
            time.sleep(0.01)
        assert not Path(f"/proc/{decoder_pid}").exists() or code is not None
        assert not Path(f"/proc/{rank1}").exists()
        assert cluster.exit_codes()[cluster.names.index("prefill-0")] is None


def test_a_replicated_prefillers_request_leaves_through_one_ranks_domain() -> None:
    """S9a: a replicated TP 2 prefiller sends each request from one rank drawn at random, and
    through that rank's own domain: one domain carries the KV, the other at most a context
    slot. (Striping every write over both domains would split the bytes about evenly.)"""
    from disagg.apps.demo import PromptSpec, run_demo

    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, num_pages=64,
                                        prefill_tp=2, decode_tp=1, replicated_kv=True)
    result = run_demo(config, [PromptSpec(token_ids=list(range(3, 60)))], max_tokens=2)
    metrics = result["metrics"]["prefill-0"]
    per_domain = [metrics[f'disagg:fabric_bytes_written_total{{domain="{d}"}}'] for d in (0, 1)]
    assert sum(per_domain) >= metrics["disagg:kv_sent_bytes_total"] > 0
    assert min(per_domain) < 0.25 * sum(per_domain), per_domain


def test_ranks_exit_with_a_node_killed_by_sigkill() -> None:
    """A TP 2 prefiller killed outright (no cleanup at all): its rank sees its stdin close
    and exits, leaving no orphan behind."""
    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, num_pages=64,
                                        prefill_tp=2)
    with LocalCluster(config) as cluster:
        (rank1,) = cluster.rank_pids["prefill-0"]
        cluster.kill("prefill-0")
        assert ended_within(rank1, 10.0)


def test_matched_tp_with_two_stand_in_domains_per_rank_uses_all_four() -> None:
    """S6a with `domains_per_rank=2`: TP 2 -> TP 2 opens four domains on the prefiller, rank
    i's pages are striped over its own two, so every domain carries KV; tokens are right."""
    from disagg.apps.demo import PromptSpec, run_demo

    config = ClusterConfig.from_options(model="tiny", num_decoders=1, page_size=4, num_pages=64,
                                        prefill_tp=2, decode_tp=2, domains_per_rank=2)
    result = run_demo(config, [PromptSpec(token_ids=list(range(3, 60)))], max_tokens=4)
    assert [r["state"] for r in result["requests"]] == ["finished_length"]
    metrics = result["metrics"]["prefill-0"]
    per_domain = {k: v for k, v in metrics.items()
                  if k.startswith("disagg:fabric_bytes_written_total{")}
    assert len(per_domain) == 4 and min(per_domain.values()) > 1000, per_domain
