"""`disagg serve prefill|decode`: run one node until told to stop (S2).

Prints `READY <host:port>` on stdout once the node accepts control connections (the demo and
the tests wait for that line), then serves until a Shutdown message, SIGTERM or Ctrl-C, and
always releases the fabric (endpoints, registrations, shm files) on the way out.
"""

from __future__ import annotations

import logging
import signal
import sys

from disagg.kv_transfer.decode_messenger import ReliabilityConfig
from disagg.node.builder import NodeConfig, build_node
from disagg.node.decode_node import DecodeNode
from disagg.node.prefill_node import PrefillNode
from disagg.utils.metrics import serve_metrics
from disagg.utils.trace import Tracer, trace_path


def _serve(node: PrefillNode | DecodeNode, metrics_port: int | None = None) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: node.stop())
    ready = f"READY {node.address}"
    if metrics_port is not None:
        host = node.address.rpartition(":")[0]
        server = serve_metrics(node.metrics, (host, metrics_port))
        ready += f" metrics={host}:{server.server_address[1]}"
    sys.stdout.write(ready + "\n")
    sys.stdout.flush()
    try:
        node.run()
        if node.shutdown_requested:
            # Asked to stop when idle: prove that nothing leaked (a non-zero exit otherwise).
            node.check_clean()
    finally:
        node.close()


def serve_prefill(config: NodeConfig, listen: str, node_id: str,
                  trace: str | None = None) -> None:
    """Run a prefiller (prefill only: it never samples, S8)."""
    logging.basicConfig(level=logging.INFO, format=f"{node_id} %(levelname)s %(message)s")
    engine, transfer, fingerprint, _ = build_node(config)
    tracer = Tracer(trace_path(trace, node_id), node_id)
    node = PrefillNode(engine, transfer, fingerprint, listen, node_id, tracer)
    node.messenger.lease_s = config.lease_s
    _serve(node, config.metrics_port)


def serve_decode(config: NodeConfig, listen: str, prefillers: list[str], node_id: str,
                 trace: str | None = None) -> None:
    """Run a decoder fed by `prefillers`; with none, a single-node mixed engine (S1)."""
    logging.basicConfig(level=logging.INFO, format=f"{node_id} %(levelname)s %(message)s")
    engine, transfer, fingerprint, _ = build_node(config)
    tracer = Tracer(trace_path(trace, node_id), node_id)
    try:
        reliability = ReliabilityConfig(
            kv_timeout_s=config.kv_timeout_s,
            retry_on_prefiller_failure=config.retry_on_prefiller_failure)
        node = DecodeNode(engine, transfer, fingerprint, prefillers, listen, node_id, tracer,
                          reliability)
    except BaseException:
        transfer.close()
        raise
    _serve(node, config.metrics_port)
