"""Where a KV cache's bytes come from (S5a, S7): torch's allocator, or cuMem on a GPU, whose
memory can be exported by fd to the process that registers every TP rank's KV."""

from __future__ import annotations

import math

import torch

from disagg.errors import ConfigError


def allocate_kv_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device,
                       memory: str = "torch") -> torch.Tensor:
    """A zeroed cache buffer from torch's allocator, or from cuMem (`CacheConfig.memory`).

    cuMem memory can be exported by fd to the one process that registers every rank's KV
    (S5a) and is GPUDirect-RDMA capable where the GPU supports it; the tensor keeps the
    allocation alive, and it is unmapped when the last view of it is gone.
    """
    device = torch.device(device)
    if memory == "torch":
        return torch.zeros(shape, dtype=dtype, device=device)
    if memory != "cumem":
        raise ConfigError(f"unknown KV memory {memory!r}: expected torch or cumem")
    if device.type != "cuda":
        raise ConfigError(f"KV memory 'cumem' is CUDA memory: the cache is on {device}")
    from transfer_core.cuda import cumem  # cuda-python, imported only when asked for

    nbytes = dtype.itemsize * math.prod(shape)
    buffer = cumem.allocate(nbytes, device.index or 0).as_tensor(dtype, shape)
    return buffer.zero_()
