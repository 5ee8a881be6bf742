"""Where a KV cache's bytes come from (S5a, S7): torch's zeroed memory, or cuMem on a GPU."""

from __future__ import annotations

import pytest
import torch

from disagg.errors import ConfigError
from disagg.model.kv_memory import allocate_kv_buffer


def test_torch_memory_is_zeroed_in_the_shape_and_dtype_asked() -> None:
    buffer = allocate_kv_buffer((2, 3, 4), torch.bfloat16, "cpu")
    assert (buffer.shape, buffer.dtype) == ((2, 3, 4), torch.bfloat16)
    assert not buffer.any()


def test_an_unknown_memory_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown KV memory 'cumme': expected torch or cumem"):
        allocate_kv_buffer((2,), torch.float32, "cpu", "cumme")


def test_cumem_is_refused_off_cuda() -> None:
    with pytest.raises(ConfigError, match="'cumem' is CUDA memory: the cache is on cpu"):
        allocate_kv_buffer((2,), torch.float32, "cpu", "cumem")
