"""cuMem-backed KV memory that one process allocates and another imports (S5a, GPU only).

With tensor parallelism each rank's process allocates its KV cache with `allocate()`
(cuMemCreate, POSIX-FD shareable, GPUDirect-RDMA capable where the device supports it) and
passes an fd over a Unix socket (SCM_RIGHTS): `send_allocation()`, or `export_allocation()`'s
fd and bus id inside a message of the caller's own. The one messenger process imports it
(`recv_allocation()` / `import_allocation()`: cuMemImportFromShareableHandle, map, set access)
and views every rank's KV as a tensor it can register with the NIC. Imports without a GPU;
every function raises `CudaError` naming the problem when CUDA is absent.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transfer_core.cuda.driver import (
    check_cu,
    device_attribute,
    device_view,
    ensure_context,
    free_on_gc,
)
from transfer_core.errors import CudaError
from transfer_core.optional import require_torch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# Wire header of send_allocation: magic, size in bytes, length of the PCI bus id that follows.
_HEADER = struct.Struct("<4sQH")
_MAGIC = b"KVM1"


@dataclass(eq=False)
class CuMemAllocation:
    """A mapped cuMem range: ``[ptr, ptr + size)`` on `device`, readable and writable there.

    `rdma` says whether it was created GPUDirect-RDMA capable; `imported` whether it came
    from another process. `close()` unmaps and releases now (idempotent); views from
    `as_tensor` must be dropped first. Without `close()` it is released once the last view
    and this object are gone.
    """

    ptr: int
    size: int
    device: int
    rdma: bool
    imported: bool
    _handle: int = field(repr=False)
    _release: weakref.finalize = field(init=False, repr=False)

    def __post_init__(self) -> None:
        args = (self.device, self.ptr, self.size, self._handle)
        self._release = free_on_gc(self, _unmap_and_release, *args)

    @property
    def closed(self) -> bool:
        """Whether the range has been unmapped."""
        return not self._release.alive

    def as_tensor(
        self,
        dtype: torch.dtype | None = None,
        shape: tuple[int, ...] | None = None,
        offset: int = 0,
    ) -> torch.Tensor:
        """A CUDA tensor over the range from byte `offset`; 1-D filling the rest if no shape.

        For a paged KV cache in HND layout, e.g. ``as_tensor(torch.bfloat16, shape)`` with
        shape ``[num_pages, 2, num_kv_heads, page_size, head_dim]``. The tensor keeps this
        allocation alive but not mapped: do not use it after `close()`. `dtype` None is uint8.
        """
        if self.closed:
            raise ValueError("CuMemAllocation is closed")
        torch = require_torch("transfer_core.cuda.cumem")
        kind = torch.uint8 if dtype is None else dtype
        itemsize = torch.empty(0, dtype=kind).element_size()
        if shape is None:
            shape = ((self.size - offset) // itemsize,)
        nbytes = itemsize * _numel(shape)
        if offset < 0 or offset % itemsize or offset + nbytes > self.size:
            raise ValueError(
                f"view of {nbytes} bytes at offset {offset} does not fit {self.size} bytes "
                f"with {kind} alignment"
            )
        return device_view(self.ptr + offset, nbytes, self.device, kind, self).view(shape)

    def export_fd(self) -> int:
        """A new POSIX file descriptor for this allocation; the caller closes it."""
        driver = ensure_context(self.device)
        handle_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        out = driver.cuMemExportToShareableHandle(self._handle, handle_type, 0)
        return int(check_cu("cuMemExportToShareableHandle", out))

    def close(self) -> None:
        """Unmap and release now; idempotent."""
        self._release()


def granularity(device: int = 0) -> int:
    """The recommended cuMem allocation granularity of `device` in bytes (often 2 MiB)."""
    driver = ensure_context(device)
    option = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    out = driver.cuMemGetAllocationGranularity(_allocation_prop(driver, device, False), option)
    return int(check_cu("cuMemGetAllocationGranularity", out))


def rdma_supported(device: int = 0) -> bool:
    """Whether `device` can create GPUDirect-RDMA capable cuMem allocations."""
    return device_attribute(device, "GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED") == 1


def allocate(nbytes: int, device: int = 0, rdma: bool | None = None) -> CuMemAllocation:
    """Create, reserve, map and enable `nbytes` (rounded up to the granularity) on `device`.

    `rdma=None` asks for GPUDirect-RDMA capable memory where supported; `True` requires it.
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    driver = ensure_context(device)
    supported = rdma_supported(device)
    if rdma and not supported:
        why = "CUDA_ERROR_NOT_SUPPORTED (GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED is 0)"
        raise CudaError("cuMemCreate", why)
    use_rdma = supported if rdma is None else bool(rdma)
    step = granularity(device)
    size = -(-nbytes // step) * step
    prop = _allocation_prop(driver, device, use_rdma)
    handle = check_cu("cuMemCreate", driver.cuMemCreate(size, prop, 0))
    try:
        ptr = _map(driver, device, handle, size)
    except BaseException:
        check_cu("cuMemRelease", driver.cuMemRelease(handle))
        raise
    logger.debug("cuMem allocated %d bytes on device %d (rdma=%s)", size, device, use_rdma)
    return CuMemAllocation(ptr, size, device, use_rdma, False, int(handle))


def import_fd(fd: int, size: int, device: int = 0) -> CuMemAllocation:
    """Import an exported allocation of `size` bytes and map it on `device`; closes `fd`.

    The imported handle holds its own reference to the memory, so the fd is not needed after.
    """
    try:
        driver = ensure_context(device)
        handle_type = driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        out = driver.cuMemImportFromShareableHandle(fd, handle_type)
        handle = check_cu("cuMemImportFromShareableHandle", out)
    finally:
        os.close(fd)
    try:
        ptr = _map(driver, device, handle, size)
    except BaseException:
        check_cu("cuMemRelease", driver.cuMemRelease(handle))
        raise
    return CuMemAllocation(ptr, size, device, False, True, int(handle))


def export_allocation(allocation: CuMemAllocation) -> tuple[int, str]:
    """A new fd for `allocation` and the PCI bus id of its GPU; the caller closes the fd.

    With the size, that is all `import_allocation` needs: for a caller that carries them in a
    message of its own (a TP rank's hello, fd and all in one sendmsg). The PCI bus id, not the
    ordinal, names the GPU, since ranks often see different CUDA_VISIBLE_DEVICES than the
    importing process.
    """
    bus_id = pci_bus_id(allocation.device)
    return allocation.export_fd(), bus_id


def import_allocation(fd: int, size: int, bus_id: str) -> CuMemAllocation:
    """Import an `export_allocation` of `size` bytes on the GPU at `bus_id`; closes `fd`."""
    try:
        device = device_by_pci_bus_id(bus_id)
    except BaseException:
        os.close(fd)
        raise
    return import_fd(fd, size, device)


def send_allocation(sock: socket.socket, allocation: CuMemAllocation) -> None:
    """Send `allocation` over a connected AF_UNIX socket: size, PCI bus id and an fd, in one
    message (`export_allocation`)."""
    fd, bus_id = export_allocation(allocation)
    try:
        encoded = bus_id.encode()
        header = _HEADER.pack(_MAGIC, allocation.size, len(encoded))
        socket.send_fds(sock, [header + encoded], [fd])
    finally:
        os.close(fd)


def recv_allocation(sock: socket.socket) -> CuMemAllocation:
    """Receive one `send_allocation` message and import it on the same physical GPU."""
    message, fds, _, _ = socket.recv_fds(sock, _HEADER.size + 64, 1)
    if len(fds) != 1 or len(message) < _HEADER.size:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"not a cuMem allocation message ({len(message)} bytes, {len(fds)} fds)")
    magic, size, id_len = _HEADER.unpack_from(message)
    if magic != _MAGIC:
        os.close(fds[0])
        raise ValueError(f"bad cuMem allocation message magic {magic!r}")
    bus_id = message[_HEADER.size : _HEADER.size + id_len].decode()
    return import_allocation(fds[0], size, bus_id)


def pci_bus_id(device: int) -> str:
    """The PCI bus id of CUDA ordinal `device`, e.g. ``0000:1B:00.0``."""
    driver = ensure_context(device)
    handle = check_cu("cuDeviceGet", driver.cuDeviceGet(device))
    raw = check_cu("cuDeviceGetPCIBusId", driver.cuDeviceGetPCIBusId(32, handle))
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.split("\x00", 1)[0]


def device_by_pci_bus_id(bus_id: str) -> int:
    """The CUDA ordinal this process gives the GPU at `bus_id`."""
    driver = ensure_context(0)
    return int(check_cu("cuDeviceGetByPCIBusId", driver.cuDeviceGetByPCIBusId(bus_id.encode())))


def _allocation_prop(driver: Any, device: int, rdma: bool) -> Any:  # noqa: ANN401
    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = (
        driver.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )
    prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
    return prop


def _map(driver: Any, device: int, handle: Any, size: int) -> int:  # noqa: ANN401
    """Reserve a VA range, map `handle` there and grant `device` read/write; the pointer."""
    ptr = check_cu("cuMemAddressReserve", driver.cuMemAddressReserve(size, 0, 0, 0))
    try:
        check_cu("cuMemMap", driver.cuMemMap(ptr, size, 0, handle, 0))
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        try:
            check_cu("cuMemSetAccess", driver.cuMemSetAccess(ptr, size, [access], 1))
        except BaseException:
            check_cu("cuMemUnmap", driver.cuMemUnmap(ptr, size))
            raise
    except BaseException:
        check_cu("cuMemAddressFree", driver.cuMemAddressFree(ptr, size))
        raise
    return int(ptr)


def _unmap_and_release(device: int, ptr: int, size: int, handle: int) -> None:
    driver = ensure_context(device)
    check_cu("cuMemUnmap", driver.cuMemUnmap(ptr, size))
    check_cu("cuMemAddressFree", driver.cuMemAddressFree(ptr, size))
    check_cu("cuMemRelease", driver.cuMemRelease(handle))


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for dim in shape:
        numel *= dim
    return numel
