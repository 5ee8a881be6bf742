"""Start a prefiller and decoders as separate local processes, and stop them all (S1).

Each node is `python -m disagg.node.serve` in its own process, talking over libfabric, so the
demo and the end-to-end tests run exactly what a multi-machine deployment runs. A node gets its
`NodeConfig` as one JSON document on stdin (`ClusterConfig.node_config`, never as flags) and
prints its `ReadyLine` once it accepts connections; every process started here is ended
on exit, error or Ctrl-C.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from disagg.control.channel import Channel
from disagg.control.messages import Shutdown
from disagg.errors import DisaggError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.ready_line import ReadyLine
from disagg.utils.metrics import parse_metrics

logger = logging.getLogger(__name__)


class LocalCluster:
    """Context manager: the nodes of a `ClusterConfig` (prefillers and decoders, or mixed
    nodes) as child processes."""

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
        try:
            nodes = self.config.nodes()
            prefillers = [(name, self._spawn(self.config.node_config(role, name)))
                          for name, role in nodes if role is NodeRole.PREFILL]
            self.prefiller_addresses = [self._wait_ready(name, process)
                                        for name, process in prefillers]
            self.prefiller_address = next(iter(self.prefiller_addresses), "")
            # Decoders (or mixed nodes) start side by side: each loads the model on its own.
            decoders = [(name, self._spawn(self.config.node_config(
                role, name, tuple(self.prefiller_addresses))))
                for name, role in nodes if role is not NodeRole.PREFILL]
            self.decoder_addresses = [self._wait_ready(name, process)
                                      for name, process in decoders]
        except BaseException:
            self.stop()
            raise
        return self

    def roles(self) -> dict[str, NodeRole]:
        """Node name -> its role, for every node started."""
        roles = dict(self.config.nodes())
        return {name: roles[name] for name in self.names}

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
            ready = ReadyLine.parse(line)
            if ready is not None:
                threading.Thread(target=_collect, args=(process.stdout, log), daemon=True).start()
                if ready.metrics_address is not None:
                    self.metrics_addresses[name] = ready.metrics_address
                if ready.rank_pids:
                    self.rank_pids[name] = list(ready.rank_pids)
                return ready.address
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
        """SIGKILL one node (a crash: no shutdown, no cleanup, X4)."""
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
