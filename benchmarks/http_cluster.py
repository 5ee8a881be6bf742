"""`disagg serve cluster` as a subprocess for `load_http.py` (X5b, X5e): start it with a
cluster secret of ours, read its `/health` and its nodes' `/metrics`, stop it with SIGINT, and
check that no node process it ever had outlives it. Nothing here sends a completion.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disagg.control.secret import SECRET_ENV
from disagg.server.scrape_targets import scrape_cluster

ROOT = Path(__file__).resolve().parent.parent
PAGES_SERIES = "disagg:kv_pages_in_use"  # each node's pages, from its own /metrics
READY_TIMEOUT_S = 120.0


class ServerError(RuntimeError):
    """The server did not start, or did not answer as a front door does."""


@dataclass
class ServeCluster:
    """One `serve cluster` process; `logs` gathers its stderr as it comes."""

    args: list[str]
    secret: str
    process: subprocess.Popen[str] | None = None
    url: str = ""
    logs: list[str] = field(default_factory=list)
    pids_seen: set[int] = field(default_factory=set)

    def start(self) -> None:
        env = dict(os.environ, **{SECRET_ENV: self.secret})
        self.process = subprocess.Popen(
            [sys.executable, "-m", "disagg.apps.cli", "serve", "cluster", "--port", "0",
             *self.args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=ROOT)
        assert self.process.stdout is not None and self.process.stderr is not None
        threading.Thread(target=self._drain, args=(self.process.stderr,), daemon=True).start()
        line = self.process.stdout.readline()
        if not line.startswith("READY "):
            self.process.kill()
            self.process.wait()
            time.sleep(0.2)
            raise ServerError(f"no READY line: {line!r} {' | '.join(self.logs[-20:])}")
        self.url = line.split()[1]

    def _drain(self, stream: Any) -> None:
        for line in stream:
            self.logs.append(line.rstrip("\n"))

    def get(self, path: str, timeout_s: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout_s) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def health(self) -> dict[str, Any]:
        """`/health`'s body (200 or 503); every node pid it names is remembered."""
        _, text = self.get("/health")
        body = json.loads(text)
        self.pids_seen.update(n["pid"] for n in body["nodes"] if n.get("pid"))
        return body

    def health_until(self, ok: Any, timeout_s: float) -> dict[str, Any] | None:
        """Poll `/health` until `ok(body)`; None if it never held within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                body = self.health()
            except (OSError, ValueError):
                body = None
            if body is not None and ok(body):
                return body
            time.sleep(0.2)
        return None

    def pages_in_use(self) -> dict[str, float]:
        """Node -> KV pages in use, scraped from each node the front door's
        `/metrics/targets` lists (as Prometheus would)."""
        return {sample.labels["node"]: sample.value for sample in scrape_cluster(self.url)
                if sample.name == PAGES_SERIES}

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGINT, as a user's Ctrl-C; its exit code (0: every node exited clean), or None
        if it had to be killed."""
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None

    def note_ranks(self, node_pid: int) -> list[int]:
        """The TP rank processes of a node (its `rank_worker` children), remembered for the
        leak check."""
        ranks = rank_pids(node_pid)
        self.pids_seen.update(ranks)
        return ranks

    def leaked(self) -> list[int]:
        """Node pids still alive after the server exited (zombies of it count as gone)."""
        alive = []
        for pid in sorted(self.pids_seen):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        return alive


def rank_pids(node_pid: int) -> list[int]:
    """The pids of `node_pid`'s TP rank workers (ranks 1.., S3c), from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == node_pid and b"rank_worker" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile
    return sorted(found)
