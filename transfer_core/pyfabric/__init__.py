"""`pyfabric`: a small cffi binding of libfabric for RDM endpoints and RMA writes (S5).

Control path as thin objects (`Fabric`, `Domain`, `CompletionQueue`, `AddressVector`,
`Endpoint`, `MemoryRegistration`, `FabricStack`), provider discovery (`find_infos`), and a C
data path (`Worker`, `WriteOp`) that posts batches of writes with immediates and drains
completion queues with the GIL released. Imports nothing from `transfer_core` but its errors.
"""

from __future__ import annotations

from ._pyfabric import ffi, lib
from .datapath import Event, ImmArrival, OpTimes, Stats, Worker, WriteOp
from .errors import FabricError, ProviderNotFoundError, check, strerror
from .info import (
    AUTO_NODE,
    DEFAULT_PROVIDERS,
    PROVIDER_ALIASES,
    Info,
    InfoRequest,
    find_infos,
    get_infos,
    resolve_providers,
)
from .objects import (
    AddressVector,
    CompletionQueue,
    Domain,
    Endpoint,
    Fabric,
    FabricStack,
    MemoryRegistration,
    check_peer_alive,
)

__all__ = [
    "AUTO_NODE",
    "DEFAULT_PROVIDERS",
    "PROVIDER_ALIASES",
    "AddressVector",
    "CompletionQueue",
    "Domain",
    "Endpoint",
    "Event",
    "Fabric",
    "FabricError",
    "FabricStack",
    "ImmArrival",
    "Info",
    "InfoRequest",
    "MemoryRegistration",
    "OpTimes",
    "ProviderNotFoundError",
    "Stats",
    "Worker",
    "WriteOp",
    "check",
    "check_peer_alive",
    "ffi",
    "find_infos",
    "get_infos",
    "lib",
    "resolve_providers",
    "strerror",
]
