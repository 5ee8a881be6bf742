"""Start a prefiller and decoders as separate local processes, and stop them all (S1).

Each node is `python -m disagg.node.serve` in its own process, talking over libfabric, so the
demo and the end-to-end tests run exactly what a multi-machine deployment runs. A node gets its
`NodeConfig` as one JSON document on stdin (built here from the `ClusterConfig`, never as
flags) and prints `READY <host:port>` once it accepts connections; every process started here
is ended on exit, error or Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from disagg.config import (
    CacheConfig,
    ParallelConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from disagg.control.channel import Channel
from disagg.control.messages import Shutdown
from disagg.errors import DisaggError
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.prefix_index import RoutingConfig
from disagg.utils.metrics import parse_metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterConfig:
    """What to start: the options every node shares, how many of each, and the decoders' own."""

    model: str
    num_decoders: int = 1
    kv_layout: str = "NHD"
    page_size: int = 16
    num_pages: int = 512
    chunk_size: int = 256
    provider: str = "tcp"
    threads_per_node: int = 1
    num_prefillers: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    replicated_kv: bool = False  # every TP rank holds all KV heads (MLA-style, S9a)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)  # decoders
    speculative: SpeculativeConfig | None = None  # decoders draft and verify (S8)
    cuda_graph: bool = False  # decoders' decode steps through CUDA graphs (S3b)
    faults: str | None = None  # test only: a FaultPlan spec for every node's fabric
    startup_timeout_s: float = 120.0
    trace_dir: str | None = None  # each node writes <node_id>.json here (a Chrome trace)
    device: str = "cpu"  # every node's model and KV cache: cpu, cuda or cuda:N
    kv_memory_path: str = "auto"  # how each node's NIC reaches its KV: auto, host, hmem, staged
    num_mixed: int = 0  # > 0: that many single-node mixed engines instead (the S1 baseline)
    prefix_caching: bool = True  # every node keeps and reuses full pages (issue 18)
    routing: str = "prefix"  # how a router in front of it picks a decoder (`router_config`)
    routing_margin: int = 4
    domains_per_rank: int = 1  # fabric domains per TP rank without RDMA NICs (S5b)

    def router_config(self) -> RoutingConfig:
        """What a router in front of this cluster does; its blocks are the nodes' pages."""
        return RoutingConfig.parse(self.routing, self.routing_margin, self.page_size)

    def node_config(self, role: NodeRole, node_id: str,
                    prefillers: tuple[str, ...] = ()) -> NodeConfig:
        """The `NodeConfig` of one node of this cluster."""
        decoder = role is NodeRole.DECODE
        mode = "prefill_only" if role is NodeRole.PREFILL else "mixed"
        return NodeConfig(
            self.model, CacheConfig(page_size=self.page_size, num_pages=self.num_pages,
                                    kv_layout=self.kv_layout,  # type: ignore[arg-type]
                                    prefix_caching=self.prefix_caching),
            SchedulerConfig(chunk_size=self.chunk_size,
                            max_num_batched_tokens=self.chunk_size,
                            mode=mode),  # type: ignore[arg-type]
            ParallelConfig(self.decode_tp if decoder else self.prefill_tp, self.replicated_kv),
            role=role, node_id=node_id, prefillers=prefillers, provider=self.provider,
            threads=self.threads_per_node, faults=self.faults, reliability=self.reliability,
            metrics_port=0, trace=self.trace_dir,
            speculative=self.speculative if decoder else None,
            device=self.device, kv_memory_path=self.kv_memory_path,
            cuda_graph=self.cuda_graph and decoder, domains_per_rank=self.domains_per_rank)


class LocalCluster:
    """Context manager: one prefiller and `num_decoders` decoders as child processes."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.processes: list[subprocess.Popen[str]] = []
        self.prefiller_address = ""
        self.prefiller_addresses: list[str] = []
        self.names: list[str] = []  # node names in process order
        self.decoder_addresses: list[str] = []
        self.logs: dict[str, list[str]] = {}
        self.metrics_addresses: dict[str, str] = {}  # node name -> host:port of /metrics
        self.rank_pids: dict[str, list[int]] = {}  # node name -> pids of its TP ranks 1..N-1

    def __enter__(self) -> LocalCluster:
        if self.config.num_mixed > 0:
            return self._start_mixed()
        try:
            prefill_names = [f"prefill-{i}" for i in range(self.config.num_prefillers)]
            prefillers = [self._spawn(self.config.node_config(NodeRole.PREFILL, name))
                          for name in prefill_names]
            self.prefiller_addresses = [self._wait_ready(name, process) for name, process
                                        in zip(prefill_names, prefillers, strict=True)]
            self.prefiller_address = self.prefiller_addresses[0]
            # Decoders start side by side: each loads the model on its own.
            names = [f"decode-{i}" for i in range(self.config.num_decoders)]
            decoders = [self._spawn(self.config.node_config(
                NodeRole.DECODE, name, tuple(self.prefiller_addresses))) for name in names]
            self.decoder_addresses = [self._wait_ready(name, process)
                                      for name, process in zip(names, decoders, strict=True)]
        except BaseException:
            self.stop()
            raise
        return self

    def _start_mixed(self) -> LocalCluster:
        """`num_mixed` single-node engines behind the same router protocol as decoders."""
        try:
            names = [f"mixed-{i}" for i in range(self.config.num_mixed)]
            nodes = [self._spawn(self.config.node_config(NodeRole.MIXED, name))
                     for name in names]
            self.decoder_addresses = [self._wait_ready(name, process)
                                      for name, process in zip(names, nodes, strict=True)]
        except BaseException:
            self.stop()
            raise
        return self

    def roles(self) -> dict[str, NodeRole]:
        """Node name -> its role, for every node started."""
        return {name: NodeRole(name.split("-")[0]) for name in self.names}

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, config: NodeConfig) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "disagg.node.serve"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        assert process.stdin is not None
        process.stdin.write(config.to_json())
        process.stdin.close()
        self.processes.append(process)
        self.names.append(config.node_id)
        log = self.logs.setdefault(config.node_id, [])
        threading.Thread(target=_collect, args=(process.stderr, log), daemon=True).start()
        return process

    def _wait_ready(self, name: str, process: subprocess.Popen[str]) -> str:
        log = self.logs[name]
        deadline = time.monotonic() + self.config.startup_timeout_s
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("READY "):
                threading.Thread(target=_collect, args=(process.stdout, log), daemon=True).start()
                words = line.split()
                for word in words[2:]:
                    if word.startswith("metrics="):
                        self.metrics_addresses[name] = word.removeprefix("metrics=")
                    if word.startswith("ranks="):
                        self.rank_pids[name] = [int(p) for p in
                                                word.removeprefix("ranks=").split(",")]
                return words[1]
            log.append(line.rstrip())
            if time.monotonic() > deadline:
                break
        process.wait(timeout=5)
        time.sleep(0.1)  # let the stderr reader catch the last lines
        raise DisaggError(f"{name} did not start (exit code {process.returncode}): "
                          + " | ".join(self.logs[name][-5:]))

    def stop(self, timeout_s: float = 10.0) -> None:
        """End every process: a Shutdown message (after which each node checks that it
        leaked nothing), then SIGTERM, then SIGKILL."""
        for address in [*self.decoder_addresses, *self.prefiller_addresses]:
            try:
                channel = Channel.connect(address, timeout_s=2.0)
                channel.send(Shutdown())
                channel.close()
            except (DisaggError, OSError):
                pass  # that node is gone already; the signals below cover the rest
        deadline = time.monotonic() + timeout_s / 2
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("killing pid %d", process.pid)
                process.kill()
                process.wait()

    def kill(self, name: str) -> None:
        """SIGKILL one node (a crash: no shutdown, no cleanup, issue 8)."""
        process = self.processes[self.names.index(name)]
        process.kill()
        process.wait()
        self.metrics_addresses.pop(name, None)

    def scrape_metrics(self) -> dict[str, dict[str, float]]:
        """Every node's metrics, read from its /metrics endpoint."""
        result = {}
        for name, address in self.metrics_addresses.items():
            try:
                with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
                    result[name] = parse_metrics(response.read().decode())
            except OSError as error:
                logger.warning("could not read the metrics of %s: %s", name, error)
        return result

    def process_table(self) -> list[dict[str, Any]]:
        """Every process started, TP ranks included: node name, rank, pid (rank 0 is the node
        process itself)."""
        rows = []
        for name, process in zip(self.names, self.processes, strict=True):
            for rank, pid in enumerate([process.pid, *self.rank_pids.get(name, [])]):
                rows.append({"node": name, "rank": rank, "pid": pid})
        return rows

    def exit_codes(self) -> list[int | None]:
        """Each process's exit code (None while running)."""
        return [process.poll() for process in self.processes]


def _collect(stream: object, log: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        log.append(line.rstrip())
