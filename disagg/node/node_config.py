"""What one node is asked to be: `NodeConfig`, frozen, checked, and sent whole to its process.

The command line's words become a `NodeConfig` in one place (`node_options.py`); a cluster
derives each of its nodes' configs from one shared one (`cluster_config.py`); a child process
receives it as one JSON document (`to_json` / `from_json`), never as flags to parse again, so
what a node runs is exactly what its parent asked for. A node listening off loopback needs the
cluster secret (`check_listen_secret`): without it anyone who can reach the port could send it
any control message.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg.config import (
    CacheConfig,
    ParallelConfig,
    ReliabilityConfig,
    SchedulerConfig,
    SchedulerMode,
    SpeculativeConfig,
    check_choice,
)
from disagg.control.address import parse_address
from disagg.control.secret import SECRET_ENV, cluster_secret
from disagg.errors import ConfigError
from disagg.utils.otlp import check_otlp_endpoint
from transfer_core.memory_paths import MEMORY_PATHS, MemoryPathRequest


class NodeRole(enum.Enum):
    """The three kinds of node (S1, S2)."""

    PREFILL = "prefill"  # prefills for decoders and streams their KV back (S2b)
    DECODE = "decode"  # takes requests, gets their KV from prefillers, decodes (S2a)
    MIXED = "mixed"  # a single node that prefills and decodes (the S1 baseline)


def scheduler_mode(role: NodeRole) -> SchedulerMode:
    """What the scheduler of a node of `role` runs: a prefiller prefills only (S2b)."""
    return "prefill_only" if role is NodeRole.PREFILL else "mixed"


def node_name(role: NodeRole, index: int) -> str:
    """The name of the `index`-th node of `role` in logs, traces and handshakes: `decode-0`."""
    return f"{role.value}-{index}"


def check_device(device: str, need_hardware: bool = True) -> str:
    """`device` if it names cpu, cuda or cuda:N (and, with `need_hardware`, this machine has
    it); else a `ConfigError` naming it."""
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {device!r}: expected cpu, cuda or cuda:N")
    if need_hardware and parsed.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: torch sees no CUDA device on this machine")
    return device


def check_listen_secret(listen: str) -> None:
    """A `ConfigError` if `listen` is malformed, or is not a loopback address while the
    environment holds no cluster secret. A host name other than localhost counts as off
    loopback: it is not resolved here, and it could name any interface."""
    try:
        host, _ = parse_address(listen)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        loopback = host == "localhost"
    if not loopback and cluster_secret() is None:
        raise ConfigError(f"listening on {listen} (not a loopback address) needs the cluster "
                          f"secret: set {SECRET_ENV} to the same value on every node")


def check_memory_path(kv_memory_path: str) -> MemoryPathRequest:
    """`kv_memory_path` if it is one of `transfer_core`'s `MEMORY_PATHS`, else a
    `ConfigError` naming it."""
    return check_choice(kv_memory_path, MEMORY_PATHS, "KV memory path")


def check_node_memory(device: str, kv_memory_path: str, need_hardware: bool = True) -> None:
    """A `ConfigError` unless `device` is valid (see `check_device`) and `kv_memory_path` is
    one of auto, host, hmem, staged and possible there (host is CPU only, hmem CUDA only)."""
    on_cuda = torch.device(check_device(device, need_hardware)).type == "cuda"
    check_memory_path(kv_memory_path)
    if kv_memory_path == ("host" if on_cuda else "hmem"):
        raise ConfigError(f"KV memory path {kv_memory_path!r} is impossible on {device}: use "
                          "auto or staged")


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Everything one node needs: built from the command line's words (`node_options.py`),
    or derived from a cluster's shared one (`ClusterConfig.node_config`)."""

    model: str
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    role: NodeRole = NodeRole.MIXED
    node_id: str = "node-0"
    listen: str = "127.0.0.1:0"  # control connections (port 0: any free port)
    prefillers: tuple[str, ...] = ()  # decoder: its prefillers' host:port
    provider: str = "tcp"  # an alias (tcp, shm, efa, verbs) or a libfabric provider name
    fabric_node: str | None = "auto"  # fabric interface: "auto" = loopback for socket providers
    threads: int | None = None  # torch intra-op threads for this node
    faults: str | None = None  # a FaultPlan spec: test-only fault injection (X4)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)  # decoder
    lease_s: float = 300.0  # prefiller: a transfer older than this is stopped
    # prefiller: a group of layers posts once its writes carry this many bytes (X9a; 0: each
    # layer alone). Measured on 2 cores, a post costs the prefiller about 0.4 ms of CPU, in
    # which the wire moves 1-2 MB: a group of 256 KiB adds under 0.1 ms of wire to the tail.
    min_post_bytes: int = 256 * 1024
    metrics_port: int | None = None  # serve Prometheus /metrics here (0: any free port)
    trace: str | None = None  # a Chrome trace: a file ({node_id} filled in) or a directory
    otlp_endpoint: str | None = None  # an OTLP/HTTP collector for requests' spans (X7a)
    speculative: SpeculativeConfig | None = None  # decoder: draft and verify (S8)
    device: str = "cpu"  # where the model and its KV cache live: cpu, cuda, cuda:N
    kv_memory_path: MemoryPathRequest = "auto"  # how the NIC reaches the KV (S5): MEMORY_PATHS
    cuda_graph: bool = False  # decode steps through static buffers / CUDA graphs (S3b)
    # Fabric domains per TP rank where no RDMA NIC is near it (stand-ins over the provider's
    # own interface); with RDMA NICs the nearest NICs decide (`rank_placement.py`, S5b).
    domains_per_rank: int = 1
    dtype: torch.dtype = torch.float32  # weights and activations; the KV's is `cache.dtype`

    def __post_init__(self) -> None:
        check_node_memory(self.device, self.kv_memory_path, need_hardware=False)
        check_listen_secret(self.listen)
        expected_mode = scheduler_mode(self.role)
        if self.scheduler.mode != expected_mode:
            raise ConfigError(f"a {self.role.value} node schedules {expected_mode!r}, "
                              f"not {self.scheduler.mode!r}")
        if self.role is not NodeRole.DECODE and self.prefillers:
            raise ConfigError(f"a {self.role.value} node takes no prefillers")
        if self.role is NodeRole.DECODE and not self.prefillers:
            raise ConfigError("a decode node needs at least one prefiller (host:port)")
        if self.role is NodeRole.PREFILL and (self.speculative or self.cuda_graph):
            raise ConfigError("a prefiller never decodes: --speculative and --cuda-graph are "
                              "decoder options")
        if self.otlp_endpoint is not None:
            check_otlp_endpoint(self.otlp_endpoint)  # before the model loads, not after
        if self.min_post_bytes < 0:
            raise ConfigError(f"min_post_bytes must be at least 0, got {self.min_post_bytes}")
        if self.domains_per_rank < 1:
            raise ConfigError(f"domains_per_rank must be at least 1, got {self.domains_per_rank}")
        if self.speculative and self.parallel.tp > 1:
            # Drafts run the model (or a head) outside the engine's step: the ranks would not
            # follow. Refused until the speculator drives the ranks too.
            raise ConfigError(f"--speculative runs on one process: not with TP "
                              f"{self.parallel.tp}")
        if self.cuda_graph and self.parallel.tp > 1:
            raise ConfigError(f"--cuda-graph runs decode graphs on one process: not with TP "
                              f"{self.parallel.tp}")

    def to_json(self) -> str:
        """This config as one JSON document (what a parent sends its child process)."""
        return json.dumps(_encode(self))

    @staticmethod
    def from_json(text: str) -> NodeConfig:
        """The config `to_json` wrote; a `ConfigError` naming what does not fit."""
        try:
            return _decode(NodeConfig, json.loads(text))
        except (json.JSONDecodeError, TypeError, ValueError, KeyError) as error:
            raise ConfigError(f"node config: {error}") from None


def _encode(value: Any) -> Any:  # noqa: ANN401 - any config value
    if dataclasses.is_dataclass(value):
        return {f.name: _encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _decode(kind: Any, value: Any) -> Any:  # noqa: ANN401 - any config type
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        origin = typing.get_origin(kind)
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        unknown = set(value) - set(hints)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)} of {kind.__name__}")
        return kind(**{name: _decode(hints[name], item) for name, item in value.items()})
    if origin is tuple:
        (item_kind, *_) = typing.get_args(kind)
        return tuple(_decode(item_kind, item) for item in value)
    if kind is torch.dtype:
        dtype = getattr(torch, value, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {value!r}")
        return dtype
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return kind(value)
    return value
