"""The Ray actor that owns one node process (X3): `ray_cluster.py` places it, Ray restarts it.

`NodeActor.__init__` starts `python -m disagg.node.serve` on the Ray node the actor runs on:
its `NodeConfig` as JSON on stdin, as `LocalCluster` does, but listening on that machine's
address at the fixed ports the driver assigned, with the cluster secret (required off
loopback). The actor lives exactly as long as its node: when the node process dies without
being asked to, the actor exits too, so Ray's `max_restarts` runs `__init__` again with the
same arguments and the node comes back at the same host:port; and a node process is told to
end when its actor dies (Linux's parent-death signal), so nothing outlives `ray.kill`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import subprocess
import sys
import threading

import ray

from disagg.control.address import format_address
from disagg.control.channel import Channel
from disagg.control.messages import Shutdown
from disagg.control.secret import SECRET_ENV
from disagg.errors import DisaggError
from disagg.node.node_config import NodeConfig
from disagg.node.ready_line import ReadyLine

LOG_LINES = 200  # the node's last lines, kept for the error when it fails to start
EXIT_CODE_NODE_DIED = 3  # the actor's exit when its node died: Ray counts it as a crash

# The node's own interpreter asks Linux to SIGTERM it when the actor's thread that started
# it is gone (the actor runs in its main thread), checks the actor did not die first, then
# runs the node module. SIGTERM, not SIGKILL: the node still closes its fabric cleanly.
CHILD = """import ctypes, os, runpy, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit("disagg: the Ray actor that started this node is gone")
runpy.run_module("disagg.node.serve", run_name="__main__", alter_sys=True)
"""


class NodeActor:
    """One node process on the Ray node this actor landed on.

    `rank_gpu_ids`: the GPUs of the other bundles of this node's placement group (its TP
    ranks'); the node process sees exactly the actor's own GPUs, then these.
    """

    def __init__(self, node_json: str, port: int, metrics_port: int, secret: str,
                 rank_gpu_ids: list[str], startup_timeout_s: float) -> None:
        # Listening off loopback needs the secret in the environment (check_listen_secret).
        os.environ[SECRET_ENV] = secret
        self.node_ip = ray.util.get_node_ip_address()
        self.ray_node_id = ray.get_runtime_context().get_node_id()
        self.config = dataclasses.replace(
            NodeConfig.from_json(node_json), listen=format_address(self.node_ip, port),
            metrics_port=metrics_port, fabric_node=self.node_ip)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        own_gpus = [str(i) for i in ray.get_gpu_ids()]
        if own_gpus:  # once each: bundles with fractional GPUs may share one
            env["CUDA_VISIBLE_DEVICES"] = ",".join(dict.fromkeys(own_gpus + rank_gpu_ids))
        self._lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self._ready = threading.Event()
        self._ready_line: ReadyLine | None = None
        self._stopping = False
        self._process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(os.getpid())], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert self._process.stdin is not None
        self._process.stdin.write(self.config.to_json())
        self._process.stdin.close()
        threading.Thread(target=self._watch, daemon=True, name="node-output").start()
        if not self._ready.wait(startup_timeout_s) or self._ready_line is None:
            self._process.kill()
            self._process.wait()
            raise DisaggError(f"{self.config.node_id} did not start on {self.node_ip} (exit "
                              f"code {self._process.returncode}): "
                              + " | ".join(list(self._lines)[-5:]))

    def _watch(self) -> None:
        """Echo the node's output into this actor's log; exit the actor if the node dies."""
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if not self._ready.is_set():
                self._ready_line = ReadyLine.parse(line)
                if self._ready_line is not None:
                    self._ready.set()
            self._lines.append(line.rstrip())
            sys.stderr.write(line)
        code = self._process.wait()
        self._ready.set()  # a node that died while starting: __init__ reports it
        if self._ready_line is not None and not self._stopping:
            sys.stderr.write(f"{self.config.node_id} exited with code {code}: the actor "
                             "exits so that Ray restarts both\n")
            sys.stderr.flush()
            os._exit(EXIT_CODE_NODE_DIED)

    def info(self) -> dict[str, object]:
        """Where the node is: its control and metrics host:port, Ray node, process id."""
        assert self._ready_line is not None, "info() before the node started"
        return {"address": self._ready_line.address,
                "metrics_address": self._ready_line.metrics_address,
                "ray_node_id": self.ray_node_id, "node_ip": self.node_ip,
                "pid": self._process.pid}

    def stop(self, timeout_s: float) -> int:
        """Ask the node to shut down (it checks it leaked nothing), then signal it; returns
        its exit code (0: clean)."""
        self._stopping = True
        try:
            assert self._ready_line is not None, "stop() before the node started"
            channel = Channel.connect(self._ready_line.address, timeout_s=2.0)
            channel.send(Shutdown())
            channel.close()
        except (DisaggError, OSError):
            self._process.terminate()  # its control port is gone: a signal does the rest
        for signal_next in (self._process.terminate, self._process.kill):
            try:
                return self._process.wait(timeout=timeout_s / 2)
            except subprocess.TimeoutExpired:
                signal_next()
        return self._process.wait()

