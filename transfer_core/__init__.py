"""`transfer_core`: KV page transfer over libfabric RMA writes with immediate data (S5, S4c).

Public surface: the `Transport` protocol and its `PagedWrite`; `TransferEngine`, the libfabric
implementation (register memory, submit writes, count immediates); `FaultyTransport` and
`FaultPlan` (fault injection over any transport); `MemoryRegion` / `MemoryRegionDescriptor`
(local handle / bytes for peers), `EngineAddress`, `ImmCounterMap`; `PhaseLog` (where a
transfer's time goes); `CounterPoller` and its `Doorbell` (S3b);
`detect_topology` (S5b); the exceptions; and `run_transfer_benchmark`. Needs numpy and cffi
only (`staging`, `cuda` import torch and cuda-python where used); `testing` holds the loopback
test double. Never imports `disagg`; `docs/transfer-core.md` is the reference page.
"""

from __future__ import annotations

from transfer_core.bench import run_transfer_benchmark
from transfer_core.doorbell import Doorbell
from transfer_core.engine import TransferEngine
from transfer_core.errors import (
    BoundsError,
    CudaError,
    DescriptorError,
    FabricError,
    PeerError,
    ProviderNotFoundError,
    TransferError,
    TransferTimeoutError,
)
from transfer_core.faults import FaultPlan, FaultyTransport
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor
from transfer_core.phases import PhaseLog
from transfer_core.poller import CounterPoller, PollerConfig
from transfer_core.topology import Topology, detect_topology
from transfer_core.transport import PagedWrite, Transport

__all__ = [
    "BoundsError",
    "CounterPoller",
    "CudaError",
    "DescriptorError",
    "Doorbell",
    "EngineAddress",
    "FabricError",
    "FaultPlan",
    "FaultyTransport",
    "ImmCounterMap",
    "MemoryRegion",
    "MemoryRegionDescriptor",
    "PagedWrite",
    "PeerError",
    "PhaseLog",
    "PollerConfig",
    "ProviderNotFoundError",
    "Topology",
    "TransferEngine",
    "TransferError",
    "TransferTimeoutError",
    "Transport",
    "detect_topology",
    "run_transfer_benchmark",
]
