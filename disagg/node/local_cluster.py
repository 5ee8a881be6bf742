"""Start a prefiller and decoders as separate local processes, and stop them all (S1, X5d-f).

Each node runs `python -m disagg.node.serve`'s entry point in its own process, talking over
libfabric, so the demo and the end-to-end tests run exactly what a multi-machine deployment
runs; the cluster's fork server (`disagg/utils/fork_server.py`, X5f) forks them from one
interpreter that has imported the node's modules, instead of each importing torch again (a
TP node's ranks come from it too). A node gets its
`NodeConfig` as one JSON document on stdin (`ClusterConfig.node_config`, never as flags) and
prints its `ReadyLine` once it accepts connections; every process started here is ended
on exit, error or Ctrl-C. Every node carries the cluster secret (`SecretScope`: the user's, or
a random one), so no one without it can talk to them. With `supervise` (what `serve cluster`
runs) a node that dies is started again at the addresses its first start got (`supervisor.py`
decides when; `restart` is how).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from disagg.control.address import parse_address
from disagg.control.channel import Channel
from disagg.control.messages import Shutdown
from disagg.errors import DisaggError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.preflight import check_cluster
from disagg.node.ready_line import ReadyLine
from disagg.node.secret_scope import SecretScope
from disagg.node.supervisor import Supervisor
from disagg.parallel.ranks import RANK_ENTRY
from disagg.utils.forked_process import ChildProcess, ForkServer
from disagg.utils.metrics import parse_metrics

logger = logging.getLogger(__name__)
NODE_ENTRY = "disagg.node.serve"  # what each node's process runs: its main()
# What the fork server imports before it forks: the node's code, and a TP rank's, since a TP
# node asks the server that forked it for its ranks (`TPRanks.start`).
PRELOAD = (NODE_ENTRY, RANK_ENTRY)


class LocalCluster:
    """Context manager: the nodes of a `ClusterConfig` (prefillers and decoders, or mixed
    nodes) as child processes; with `supervise`, restarted when they die. `on_node(name,
    event)` hears each node's first start: "starting", then "ready" (a progress display)."""

    def __init__(self, config: ClusterConfig, supervise: bool = False,
                 on_node: Callable[[str, str], None] | None = None) -> None:
        self.config = config
        self.supervise = supervise
        self._on_node = on_node or (lambda name, event: None)
        self.processes: list[ChildProcess] = []  # each node's current process
        self.prefiller_address = ""
        self.prefiller_addresses: list[str] = []
        self.names: list[str] = []  # node names in process order
        self.decoder_addresses: list[str] = []
        self.logs: dict[str, list[str]] = {}  # every start's lines, restarts included
        self.metrics_addresses: dict[str, str] = {}  # node name -> host:port of /metrics
        self.rank_pids: dict[str, list[int]] = {}  # node name -> pids of its TP ranks 1..N-1
        self.supervisor: Supervisor | None = None
        self._configs: dict[str, NodeConfig] = {}  # as started, its ports pinned once known
        self._secret: SecretScope | None = None
        self._forks: ForkServer | None = None
        # Held to start a process and to begin stopping: no restart starts one after stop()
        # has taken the list of processes to end.
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def __enter__(self) -> LocalCluster:
        check_cluster(self.config)  # a missing provider fails here, not in every child
        try:
            self._secret = SecretScope()  # before the first child: each inherits it
            nodes = self.config.nodes()
            prefillers = [(name, self._spawn(self.config.node_config(role, name)))
                          for name, role in nodes if role is NodeRole.PREFILL]
            self.prefiller_addresses = [self._first_ready(name, process)
                                        for name, process in prefillers]
            self.prefiller_address = next(iter(self.prefiller_addresses), "")
            # Decoders (or mixed nodes) start side by side: each loads the model on its own.
            decoders = [(name, self._spawn(self.config.node_config(
                role, name, tuple(self.prefiller_addresses))))
                for name, role in nodes if role is not NodeRole.PREFILL]
            self.decoder_addresses = [self._first_ready(name, process)
                                      for name, process in decoders]
            if self.supervise:
                self.supervisor = Supervisor(self, list(self.names)).start()
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

    @property
    def stopping(self) -> bool:
        """Whether `stop()` has begun (the supervisor restarts nothing from then on)."""
        return self._stopping.is_set()

    def process_of(self, name: str) -> ChildProcess:
        """The node's current process (a restart replaces it)."""
        return self.processes[self.names.index(name)]

    def restart_count(self, name: str) -> int:
        """How many times the supervisor started `name` again (0 without supervision)."""
        return self.supervisor.restarts(name) if self.supervisor is not None else 0

    def _spawn(self, config: NodeConfig) -> ChildProcess:
        with self._lock:
            if self._stopping.is_set():
                raise DisaggError(f"{config.node_id} not started: the cluster is stopping")
            process = self._start_process(config)
            self.processes.append(process)
            self.names.append(config.node_id)
        self._on_node(config.node_id, "starting")
        return process

    def _start_process(self, config: NodeConfig) -> ChildProcess:
        assert self._secret is not None, "__enter__ holds the secret before any start"
        if self._forks is None or not self._forks.alive:  # a dead one would stop restarts
            if self._forks is not None:
                self._forks.close()
            # The nodes inherit the server's environment: the secret's, unbuffered.
            self._forks = ForkServer.launch(PRELOAD, self._secret.child_env(PYTHONUNBUFFERED="1"))
        process = self._forks.start(NODE_ENTRY)
        assert process.stdin is not None
        process.stdin.write(config.to_json())
        process.stdin.close()
        self._configs[config.node_id] = config
        log = self.logs.setdefault(config.node_id, [])
        threading.Thread(target=_collect, args=(process.stderr, log), daemon=True).start()
        return process

    def restart(self, name: str) -> bool:
        """Start node `name` again where it listened (same control and metrics ports, so its
        peers' reconnection finds it), and wait for its READY line; False if the cluster is
        stopping (nothing started). A `DisaggError` if it did not start (it is ended then)."""
        with self._lock:
            if self._stopping.is_set():
                return False
            process = self._start_process(self._configs[name])
            self.processes[self.names.index(name)] = process
            self.rank_pids.pop(name, None)
            self.metrics_addresses.pop(name, None)
        self.logs[name].append(f"--- {name} started again as pid {process.pid} ---")
        self._wait_ready(name, process)
        return True

    def _first_ready(self, name: str, process: ChildProcess) -> str:
        address = self._wait_ready(name, process)
        self._on_node(name, "ready")
        return address

    def _wait_ready(self, name: str, process: ChildProcess) -> str:
        """Read the node's stdout up to its READY line; pins its ports in its config, so a
        restart comes back at the same addresses (they were port 0, any free one)."""
        log = self.logs[name]
        deadline = time.monotonic() + self.config.startup_timeout_s
        assert process.stdout is not None
        for line in process.stdout:
            ready = ReadyLine.parse(line)
            if ready is not None:
                threading.Thread(target=_collect, args=(process.stdout, log), daemon=True).start()
                metrics_port = None
                if ready.metrics_address is not None:
                    self.metrics_addresses[name] = ready.metrics_address
                    metrics_port = parse_address(ready.metrics_address)[1]
                if ready.rank_pids:
                    self.rank_pids[name] = list(ready.rank_pids)
                self._configs[name] = replace(self._configs[name], listen=ready.address,
                                              metrics_port=metrics_port)
                return ready.address
            log.append(line.rstrip())
            if time.monotonic() > deadline:
                break
        if process.poll() is None:  # silent past its deadline: end it, it will not serve
            process.kill()
        process.wait()
        time.sleep(0.1)  # let the stderr reader catch the last lines
        raise DisaggError(f"{name} did not start (exit code {process.returncode}): "
                          + " | ".join(self.logs[name][-5:]))

    def stop(self, timeout_s: float = 10.0) -> None:
        """End every process: a Shutdown message (after which each node checks that it
        leaked nothing), then SIGTERM, then SIGKILL. Nothing is restarted from here on, and
        this process's cluster secret is put back as it was."""
        with self._lock:
            self._stopping.set()
            processes = list(self.processes)
        for address in [*self.decoder_addresses, *self.prefiller_addresses]:
            try:
                channel = Channel.connect(address, timeout_s=2.0)
                channel.send(Shutdown())
                channel.close()
            except (DisaggError, OSError):
                pass  # that node is gone already; the signals below cover the rest
        deadline = time.monotonic() + timeout_s / 2
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("killing pid %d", process.pid)
                process.kill()
                process.wait()
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._forks is not None:
            self._forks.close()
        if self._secret is not None:
            self._secret.restore()

    def kill(self, name: str) -> None:
        """SIGKILL one node (a crash: no shutdown, no cleanup, X4)."""
        process = self.process_of(name)
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
