"""`transfer_core`: KV page transfer over libfabric RMA writes with immediate data (S5, S4c).

Public surface: the `Transport` protocol and its `PagedWrite`; `TransferEngine`, the libfabric
implementation (register memory, submit writes, count immediates); `FaultyTransport` and
`FaultPlan` (fault injection over any transport); `MemoryRegion` / `MemoryRegionDescriptor`
(local handle / bytes for peers), `EngineAddress`, `ImmCounterMap`, and the
`run_transfer_benchmark` entry point. Never imports `disagg`; `README.md` is the reference page.
"""

from __future__ import annotations

from transfer_core.bench import run_transfer_benchmark
from transfer_core.engine import TransferEngine
from transfer_core.faults import FaultPlan, FaultyTransport
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor
from transfer_core.transport import PagedWrite, Transport

__all__ = [
    "EngineAddress",
    "FaultPlan",
    "FaultyTransport",
    "ImmCounterMap",
    "MemoryRegion",
    "MemoryRegionDescriptor",
    "PagedWrite",
    "TransferEngine",
    "Transport",
    "run_transfer_benchmark",
]
