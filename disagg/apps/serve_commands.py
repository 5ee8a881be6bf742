"""`disagg serve prefill|decode|mixed`: one node of a deployment per process (S2, S4).

Each command takes the node options its role uses (`options.with_node_options`: the flags
and defaults of the one mapping, `disagg.node.node_options`) and runs the one `NodeConfig`
they describe, built whole and checked once; `disagg.node.serve` runs it. `serve cluster`
(`front_door_commands.py`) reads the same flags into the config its nodes share.
"""

from __future__ import annotations

import typer

from disagg.apps.options import (
    DECODER,
    LOG_LEVEL,
    ONE_NODE,
    REQUIRED,
    SHARED,
    LogLevelOption,
    NodeOptions,
    configure_logging,
    with_node_options,
)
from disagg.node.node_config import NodeConfig, NodeRole
from disagg.node.node_options import node_config_from_options

serve_app = typer.Typer(help="Run one node of a disaggregated deployment.",
                        no_args_is_help=True)

# Every node names its model; a decoder its prefillers.
NODE = ("model", *SHARED, *ONE_NODE)


def _run(config: NodeConfig) -> None:
    from disagg.node.serve import run_node  # loads torch models: only when a node starts

    run_node(config)


@serve_app.command("prefill")
@with_node_options(NODE)
def serve_prefill(node_options: NodeOptions, log_level: LogLevelOption = LOG_LEVEL) -> None:
    """Run a prefiller: prefill requests from decoders and stream their KV back."""
    configure_logging(log_level)
    _run(node_config_from_options(NodeRole.PREFILL, **node_options))


@serve_app.command("decode")
@with_node_options((*NODE, "prefillers", *DECODER), prefillers=REQUIRED)
def serve_decode(node_options: NodeOptions, log_level: LogLevelOption = LOG_LEVEL) -> None:
    """Run a decoder: take requests, get their KV from prefillers, decode them."""
    configure_logging(log_level)
    _run(node_config_from_options(NodeRole.DECODE, **node_options))


@serve_app.command("mixed")
@with_node_options((*NODE, "cuda_graph"))
def serve_mixed(node_options: NodeOptions, log_level: LogLevelOption = LOG_LEVEL) -> None:
    """Run a single-node engine (prefill and decode mixed, S1) behind the router protocol."""
    configure_logging(log_level)
    _run(node_config_from_options(NodeRole.MIXED, **node_options))
