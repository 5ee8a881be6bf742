"""Checks a run needs no model for, made before any model loads (S2, S5, X1, X5d, X7c).

Loading weights and starting nodes takes seconds to minutes; a port another server holds, a
libfabric provider this machine lacks, a node listening off loopback without the cluster
secret, or a model that names nothing would otherwise fail only after that, often as a
traceback. Each check here is cheap and raises one specific error (`PreflightError`,
`ModelLoadError`, `ConfigError`) that the CLI prints as one line with exit code 2.
`check_node` is what `serve.run_node` runs, `check_cluster` what a local cluster, the demo
and `serve cluster` run, `check_http` what the front door runs before its cluster starts.
Not a health check: nothing here watches a running node.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from disagg.config import PRESETS
from disagg.control.address import format_address, listen, parse_address
from disagg.errors import ConfigError, ModelLoadError, PreflightError
from disagg.node.cluster_config import ClusterConfig
from disagg.node.node_config import NodeConfig, check_listen_secret

SMOLLM2 = "smollm2-135m"  # registry.SMOLLM2_NAME, which would import every loader


def check_port(address: str, flag: str) -> None:
    """A `PreflightError` unless this process could listen on `address` now (port 0: the
    host is an interface of this machine). The socket is closed at once; the server binds
    it again when it starts, with the same SO_REUSEADDR (`control.address.listen`)."""
    try:
        listen(address).close()
    except ValueError as error:
        raise ConfigError(f"{flag}: {error}") from None
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        hint = "; is another server on it?" if error.errno == errno.EADDRINUSE else ""
        raise PreflightError(f"{flag} {address}: cannot listen there ({reason}){hint}") \
            from None


def check_provider(provider: str, fabric_node: str | None = "auto") -> None:
    """A `PreflightError` unless libfabric offers `provider` (an alias such as tcp, or a
    provider name) with what the transfer engine needs: RDM endpoints, RMA writes, CQ data."""
    from transfer_core.errors import ProviderNotFoundError
    from transfer_core.pyfabric import find_infos

    try:
        find_infos(provider, node=fabric_node)
    except ProviderNotFoundError as error:
        raise PreflightError(f"--provider {provider}: this machine's libfabric does not offer "
                             f"it ({error}); `fi_info -l` lists the providers it has") from None


def check_model_spec(spec: str) -> None:
    """A `ModelLoadError` unless `spec` is smollm2-135m, a preset, a checkpoint directory
    with a config.json or has a Hub id's shape (owner/name). No file is read, nothing
    downloaded: only whether the name can name a model."""
    from disagg.model.loading.hub import is_hub_id

    path = Path(spec).expanduser()
    if spec == SMOLLM2 or spec in PRESETS or is_hub_id(spec):
        return
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelLoadError(f"model {spec!r}: the directory has no config.json (a Hugging "
                             "Face checkpoint directory holds config.json and safetensors)")
    if not path.is_dir():
        raise ModelLoadError(f"unknown model {spec!r}: expected {SMOLLM2}, a preset "
                             f"({', '.join(sorted(PRESETS))}), a Hugging Face checkpoint "
                             "directory or a Hub id (owner/name)")


def check_node(config: NodeConfig) -> None:
    """What one node needs before it loads its model: a model name, its provider, the
    secret if it listens off loopback, its control and metrics ports free."""
    check_model_spec(config.model)
    check_provider(config.provider, config.fabric_node)
    check_listen_secret(config.listen)
    check_port(config.listen, "--listen")
    if config.metrics_port is not None:
        host, _ = parse_address(config.listen)
        check_port(format_address(host, config.metrics_port), "--metrics-port")


def check_cluster(config: ClusterConfig, local: bool = True) -> None:
    """What a cluster's nodes need before any starts: a model name and, for nodes started on
    this machine (`local`), the provider. Their ports are any free ones."""
    check_model_spec(config.node.model)
    if local:
        check_provider(config.node.provider, config.node.fabric_node)


def check_http(host: str, port: int) -> None:
    """The front door's address free, before the cluster behind it starts (which takes
    as long as loading the model)."""
    check_port(format_address(host, port), "--host/--port")
