"""What every node builds at start-up: the engine, the transfer engine, a model fingerprint.

Kept apart from the node loops so the demo, the tests and `disagg serve` build nodes the same way.
"""

from __future__ import annotations

import ctypes
import hashlib
from dataclasses import dataclass, field, fields

import torch

from disagg.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig
from disagg.draft import SpeculativeConfig
from disagg.engine import LLMEngine, build_engine
from disagg.spec_engine import enable_speculation
from disagg.weights import LoadedModel, load_model
from transfer_core.engine import TransferEngine
from transfer_core.faults import FaultPlan, FaultyTransferEngine


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Options every node takes (the CLI builds this, nothing else)."""

    model: str
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    provider: str = "tcp"  # an alias (tcp, shm, efa, verbs) or a libfabric provider name
    fabric_node: str | None = "auto"  # fabric interface: "auto" = loopback for socket providers
    threads: int | None = None  # torch intra-op threads for this node
    faults: str | None = None  # a FaultPlan spec: test-only fault injection (issue 8)
    kv_timeout_s: float = 120.0  # decoder: deadline for a request's KV to arrive
    retry_on_prefiller_failure: bool = True  # decoder: else a dead prefiller's requests fail
    lease_s: float = 300.0  # prefiller: a transfer older than this is stopped
    metrics_port: int | None = None  # serve Prometheus /metrics here (0: any free port)
    speculative: SpeculativeConfig | None = None  # decoder: draft and verify (issue 6)


def model_fingerprint(loaded: LoadedModel) -> str:
    """A short digest of the model's shape and weights: peers must agree on it exactly."""
    digest = hashlib.sha256()
    for f in fields(loaded.config):
        digest.update(f"{f.name}={getattr(loaded.config, f.name)};".encode())
    for name in sorted(loaded.state_dict):
        tensor = loaded.state_dict[name].reshape(-1)
        # A strided sample of every tensor: enough to tell checkpoints apart, cheap to hash.
        sample = tensor[:: max(1, tensor.numel() // 256)].to(torch.float32).contiguous()
        digest.update(name.encode())
        digest.update(sample.numpy().tobytes())
    return f"{loaded.config.name}-{digest.hexdigest()[:16]}"


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the kernel at every free.

    Each decode step gathers megabytes of KV per layer; with glibc's default thresholds that
    memory is unmapped on free and faulted back in (and zeroed) by the next layer, which made a
    decoder node's steps 2-2.5 times slower than the same batch in a long-lived process.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    libc.mallopt(m_mmap_threshold, 32 << 20)
    libc.mallopt(m_trim_threshold, 1 << 30)


def build_node(config: NodeConfig) -> tuple[LLMEngine, TransferEngine, str, LoadedModel]:
    """Load the model, build the engine and open the fabric; returns them and the fingerprint."""
    keep_freed_memory()
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = load_model(config.model)
    engine = build_engine(EngineConfig(loaded.config, config.cache, config.scheduler,
                                       config.parallel), loaded.state_dict)
    if config.speculative is not None:
        enable_speculation(engine, config.speculative)
    if config.faults:
        transfer: TransferEngine = FaultyTransferEngine(
            config.provider, node=config.fabric_node, faults=FaultPlan.parse(config.faults))
    else:
        transfer = TransferEngine(config.provider, node=config.fabric_node)
    return engine, transfer, model_fingerprint(loaded), loaded
