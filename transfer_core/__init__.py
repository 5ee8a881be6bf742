"""`transfer_core`: KV page transfer over libfabric RMA writes with immediate data (S5, S4c).

Public surface: `TransferEngine` (register memory, submit writes, count immediates),
`MemoryRegion` / `MemoryRegionDescriptor` (local handle / bytes for peers), `EngineAddress`,
`ImmCounterMap`, and the `run_transfer_benchmark` entry point. Never imports `disagg`.
"""

from __future__ import annotations

from transfer_core.bench import run_transfer_benchmark
from transfer_core.engine import TransferEngine
from transfer_core.imm_counter import ImmCounterMap
from transfer_core.memory import EngineAddress, MemoryRegion, MemoryRegionDescriptor

__all__ = [
    "EngineAddress",
    "ImmCounterMap",
    "MemoryRegion",
    "MemoryRegionDescriptor",
    "TransferEngine",
    "run_transfer_benchmark",
]
