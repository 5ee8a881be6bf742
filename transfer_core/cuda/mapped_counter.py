"""Mapped pinned host memory for layer counters, through cuda-python's driver API (S3b).

`MappedCounter` is one int64 word that a captured CUDA graph bumps through its device alias
(`device_tensor.add_(1)`) and the `CounterPoller` reads through its host address, so graph
replays drive transfers with no Python in the forward. Importing this module needs neither a
GPU, cuda-python nor torch.
"""

from __future__ import annotations

import ctypes

from transfer_core.cuda.driver import check_cu, device_view, ensure_context, free_on_gc
from transfer_core.errors import CudaError
from transfer_core.optional import require_torch


class MappedCounter:
    """One int64 counter word in mapped pinned host memory, zero on creation.

    `host_address` is what `CounterPoller` watches; `device_tensor` (shape ``[1]``, int64,
    on ``cuda:device``) is what the model bumps with `add_(1)`, also inside a captured graph;
    `host_tensor` is a CPU view of the same word. The memory is never write-combined, since
    the CPU reads it (see the ordering NOTE in `counter_word.py`). `close()` frees it at once and
    must come after the views are dropped; otherwise it is freed when the last view goes.
    """

    def __init__(self, device: int = 0) -> None:
        torch = require_torch("transfer_core.cuda.mapped_counter")
        driver = ensure_context(device)
        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
        host = int(check_cu("cuMemHostAlloc", driver.cuMemHostAlloc(8, flags)))
        self._free = free_on_gc(self, _free_host, device, host)
        try:
            dptr = check_cu("cuMemHostGetDevicePointer", driver.cuMemHostGetDevicePointer(host, 0))
        except CudaError:
            self._free()
            raise
        self.device = device
        self.host_address = host
        self.device_address = int(dptr)
        word = (ctypes.c_int64 * 1).from_address(host)
        word.owner = self  # the CPU view, like the CUDA one, keeps the memory alive
        self.host_tensor = torch.frombuffer(word, dtype=torch.int64)
        self.host_tensor.zero_()
        self.device_tensor = device_view(self.device_address, 8, device, torch.int64, self)

    @property
    def value(self) -> int:
        """The counter as the host sees it now."""
        return int(self.host_tensor[0])

    def close(self) -> None:
        """Free the pinned memory now (idempotent); views must not be used afterwards."""
        self._free()

    def __enter__(self) -> MappedCounter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _free_host(device: int, host: int) -> None:
    driver = ensure_context(device)
    check_cu("cuMemFreeHost", driver.cuMemFreeHost(host))
