"""What every node builds at start-up: the engine, the transfer engine, a model fingerprint.

Kept apart from the node loops so the demo, the tests and `disagg serve` build nodes the same way.
It also decides how the KV memory meets the fabric (S5): on CUDA the transfer engine asks for
FI_HMEM and falls back to host staging when no provider has it; the messengers then register
their KV through `transfer_core.staging` with the engine's `memory_path`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from dataclasses import dataclass, field, fields

import torch

from disagg.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    check_kv_layout,
)
from disagg.engine.llm_engine import LLMEngine, build_engine
from disagg.errors import ConfigError
from disagg.model.draft_heads import SpeculativeConfig
from disagg.model.loading.registry import LoadedModel, load_model
from disagg.spec.speculator import enable_speculation
from transfer_core.engine import MEMORY_PATHS, TransferEngine
from transfer_core.staging import open_engine
from transfer_core.testing.faults import FaultPlan, FaultyTransferEngine

logger = logging.getLogger(__name__)


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


def check_node_memory(device: str, kv_memory_path: str, need_hardware: bool = True) -> None:
    """A `ConfigError` unless `device` is valid (see `check_device`) and `kv_memory_path` is
    one of auto, host, hmem, staged and possible there (host is CPU only, hmem CUDA only)."""
    on_cuda = torch.device(check_device(device, need_hardware)).type == "cuda"
    if kv_memory_path not in MEMORY_PATHS:
        raise ConfigError(f"unknown KV memory path {kv_memory_path!r}: expected "
                          f"{', '.join(MEMORY_PATHS[:-1])} or {MEMORY_PATHS[-1]}")
    if kv_memory_path == ("host" if on_cuda else "hmem"):
        raise ConfigError(f"KV memory path {kv_memory_path!r} is impossible on {device}: use "
                          "auto or staged")


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
    device: str = "cpu"  # where the model and its KV cache live: cpu, cuda, cuda:N
    kv_memory_path: str = "auto"  # how the NIC reaches the KV: auto, host, hmem, staged (S5)
    cuda_graph: bool = False  # decode steps through static buffers / CUDA graphs (S3b)

    def __post_init__(self) -> None:
        check_node_memory(self.device, self.kv_memory_path, need_hardware=False)


def node_config(model: str, kv_layout: str, page_size: int, num_pages: int, chunk_size: int,
                provider: str, threads: int, mode: str, tp: int = 1,
                replicated_kv: bool = False, faults: str | None = None,
                kv_timeout: float = 120.0, lease: float = 300.0,
                metrics_port: int | None = None, device: str = "cpu",
                kv_memory_path: str = "auto", cuda_graph: bool = False) -> NodeConfig:
    """A `NodeConfig` from `disagg serve`'s flat options (threads 0: torch's default)."""
    return NodeConfig(model, CacheConfig(page_size=page_size, num_pages=num_pages,
                                         kv_layout=check_kv_layout(kv_layout)),
                      SchedulerConfig(chunk_size=chunk_size, max_num_batched_tokens=chunk_size,
                                      mode=mode),  # type: ignore[arg-type]
                      ParallelConfig(tp, replicated_kv), provider=provider,
                      threads=threads or None, faults=faults, kv_timeout_s=kv_timeout,
                      lease_s=lease, metrics_port=metrics_port, device=device,
                      kv_memory_path=kv_memory_path, cuda_graph=cuda_graph)


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
    check_device(config.device)  # before the model loads: this machine must have it
    keep_freed_memory()
    if config.threads:
        torch.set_num_threads(config.threads)
    loaded = load_model(config.model)
    engine = build_engine(EngineConfig(loaded.config, config.cache, config.scheduler,
                                       config.parallel, device=config.device,
                                       cuda_graph=config.cuda_graph),
                          loaded.state_dict)
    if config.speculative is not None:
        enable_speculation(engine, config.speculative)
    if engine.runner.graphs is not None:
        # Capture before serving, not during a request's first decode. A prefiller swaps in
        # its layer counter later, which drops these for recapture on first use.
        engine.runner.graphs.capture_all()
    return engine, open_transfer(config), model_fingerprint(loaded), loaded


def open_transfer(config: NodeConfig) -> TransferEngine:
    """The node's transfer engine. KV on CUDA with path auto or hmem asks for FI_HMEM first;
    without a provider that has it, the engine opens without, so auto stages through host
    memory and hmem fails at registration with the provider's name (both say why)."""
    want_hmem = (torch.device(config.device).type == "cuda"
                 and config.kv_memory_path in ("auto", "hmem"))
    kwargs: dict[str, object] = {"node": config.fabric_node, "memory_path": config.kv_memory_path}
    if config.faults:
        return open_engine(config.provider, want_hmem, FaultyTransferEngine,
                           faults=FaultPlan.parse(config.faults), **kwargs)
    return open_engine(config.provider, want_hmem, **kwargs)
