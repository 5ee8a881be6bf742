"""Run one node until told to stop (S2): what `disagg serve prefill|decode|mixed` and every
`LocalCluster` child run.

`run_node(config)` builds the node (`builder.build_node`), prints `READY <host:port>` on stdout
once it accepts control connections (the demo and the tests wait for that line; a TP node
adds `ranks=PID,...`, its rank processes), then serves
until a Shutdown message, SIGTERM or Ctrl-C, and always releases the fabric (endpoints,
registrations, shm files) on the way out; a clean exit then skips the interpreter's
teardown (`exit_without_teardown`). `python -m disagg.node.serve` reads the node's
`NodeConfig` as one JSON document on stdin: how a parent hands its child the exact config.
With a metrics port the node also answers `GET /metrics` and `GET /health` there
(`health_report`: 200 while it runs, 503 once it stops).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Any

from disagg.control.address import format_address, parse_address
from disagg.errors import ConfigError, DisaggError
from disagg.node.base import NodeBase
from disagg.node.builder import build_node
from disagg.node.log_level import node_log_level
from disagg.node.node_config import NodeConfig
from disagg.node.preflight import check_node
from disagg.node.ready_line import ReadyLine
from disagg.utils.metrics import serve_metrics


def node_state(node: NodeBase) -> str:
    """The node's own view of its health while it runs: "ok", or why not (a decoder whose
    prefillers are all gone says "no_prefiller")."""
    return node.health_state()


def health_report(config: NodeConfig, state: str, rank_pids: list[int] = (),
                  peers: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `/health` body: who answers and its state ("ok": 200, any other state: 503), the
    processes it runs (rank 0 is this one) and its peers as it sees them (a decoder's
    prefillers)."""
    return {"node_id": config.node_id, "role": config.role.value, "state": state,
            "pid": os.getpid(), "ranks": [os.getpid(), *rank_pids], **(peers or {})}


def run_node(config: NodeConfig) -> None:
    """Check what needs no model (`preflight.check_node`: ports, provider, secret), then build
    the node `config` describes and serve until told to stop."""
    # --log-level, through the environment; force: the command line may have configured
    # logging already, and a node's lines must carry its id.
    logging.basicConfig(level=node_log_level(), force=True,
                        format=f"{config.node_id} %(levelname)s %(message)s")
    check_node(config)  # seconds before the model would have loaded, and one line
    node = build_node(config)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: node.stop())
    stopping = threading.Event()  # set once run() returns: /health says "stopping" then

    def health() -> dict[str, Any]:
        return health_report(config, "stopping" if stopping.is_set() else node_state(node),
                             node.rank_pids, node.peer_view())

    try:
        metrics_address = None
        if config.metrics_port is not None:
            host, _ = parse_address(node.address)
            try:
                server = serve_metrics(node.metrics, (host, config.metrics_port), health)
            except OSError as error:
                raise ConfigError(f"--metrics-port {config.metrics_port}: cannot listen on "
                                  f"{host}: {error.strerror or error}") from None
            metrics_address = format_address(host, server.server_address[1])
        ready = ReadyLine(node.address, tuple(node.rank_pids), metrics_address)
        sys.stdout.write(ready.format() + "\n")
        sys.stdout.flush()
        node.run()
        if node.shutdown_requested:
            # Asked to stop: end what is in flight, then prove that nothing leaked (a
            # non-zero exit otherwise).
            node.wind_down()
            node.check_clean()
    finally:
        stopping.set()
        node.close()


def main() -> None:
    """Entry point of a child process: its `NodeConfig` arrives as JSON on stdin. An error
    the user can fix is one line on stderr and exit code 2, as in the CLI."""
    try:
        run_node(NodeConfig.from_json(sys.stdin.read()))
    except DisaggError as error:
        sys.stderr.write(f"error: {error}\n")
        raise SystemExit(2) from None
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> None:
    """Exit once the node has released and checked everything it holds: run the exit
    handlers (logging's flush, exporters), then leave without the interpreter's teardown of
    torch's modules, which frees only memory and takes half a second idle, several seconds
    on a loaded host: long enough for a parent's grace period to run out and turn a clean
    exit into a SIGTERM (the interpreter has put the default handler back by then). Threads
    are not joined: after `node.close()` only daemon threads are left."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a parent that closed the pipe
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
