"""Tests of memory descriptors, engine addresses and buffer resolution (S5)."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable

import numpy as np
import pytest
import torch

from transfer_core.errors import DescriptorError
from transfer_core.memory import EngineAddress, MemoryRegionDescriptor, resolve_buffer


def _descriptor(**changes: object) -> MemoryRegionDescriptor:
    base = MemoryRegionDescriptor(
        name="kv-layer0",
        provider="tcp;ofi_rxm",
        base=0x7F00_0000_1000,
        length=1 << 20,
        virt_addr=True,
        writable=True,
        domains=((b"\x02\x00\x12\x34" + bytes(12), 17), (b"addr2", 2**63)),
    )
    return dataclasses.replace(base, **changes)


def test_descriptor_round_trip() -> None:
    """to_bytes/from_bytes preserves every field."""
    desc = _descriptor()
    assert MemoryRegionDescriptor.from_bytes(desc.to_bytes()) == desc


@pytest.mark.parametrize(("virt", "expected"), [(True, 0x7F00_0000_1000 + 64), (False, 64)])
def test_remote_addr_honours_virt_addr(virt: bool, expected: int) -> None:
    """FI_MR_VIRT_ADDR: raddr = base VA + offset; otherwise the offset itself."""
    assert _descriptor(virt_addr=virt).remote_addr(64) == expected


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b + b"\x00", "trailing"),
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + b"\x09" + b[5:], "version"),
        (lambda b: b[:5] + b"\x80" + b[6:], "flags"),
        (lambda b: b"", "truncated"),
    ],
)
def test_descriptor_rejects_malformed_bytes(mangle: Callable[[bytes], bytes], message: str) -> None:
    """Corrupt or foreign bytes raise DescriptorError, never a half-built descriptor."""
    with pytest.raises(DescriptorError, match=message):
        MemoryRegionDescriptor.from_bytes(mangle(_descriptor().to_bytes()))


def test_descriptor_rejects_engine_address_bytes() -> None:
    """The two wire formats cannot be confused for each other."""
    address = EngineAddress("shm", (b"fi_shm://1:0:0\x00",)).to_bytes()
    with pytest.raises(DescriptorError, match="magic"):
        MemoryRegionDescriptor.from_bytes(address)


def test_engine_address_round_trip() -> None:
    """Several domains' endpoint names survive the trip."""
    address = EngineAddress("tcp;ofi_rxm", (b"a" * 16, b"b" * 16))
    assert EngineAddress.from_bytes(address.to_bytes()) == address


def test_engine_address_probes_round_trip() -> None:
    """The per-domain warm-up targets (key, raddr) survive the trip; their count must match."""
    address = EngineAddress("shm", (b"a" * 16, b"b" * 16), ((1, 0x7F00_0000_1000), (2**63, 0)))
    assert EngineAddress.from_bytes(address.to_bytes()) == address
    with pytest.raises(ValueError, match="probes"):
        EngineAddress("shm", (b"a",), ((1, 0), (2, 0)))
    raw = bytearray(EngineAddress("shm", (b"a",), ((1, 0),)).to_bytes())
    raw[-17] = 2  # claims two probes for one domain, and is then truncated
    with pytest.raises(DescriptorError):
        EngineAddress.from_bytes(bytes(raw))


def test_resolve_bytearray_is_writable() -> None:
    """A bytearray resolves to its own address and size and is writable."""
    buf = bytearray(b"abcd")
    info = resolve_buffer(buf)
    assert info.nbytes == 4
    assert info.writable
    assert info.cuda_device is None


def test_resolve_bytes_is_read_only() -> None:
    """bytes can only be a write source: resolve marks it read-only."""
    assert not resolve_buffer(b"abcd").writable


def test_resolve_numpy_array_address() -> None:
    """A numpy array resolves to its data pointer and byte size."""
    arr = np.zeros((4, 8), dtype=np.float32)
    info = resolve_buffer(arr)
    assert (info.ptr, info.nbytes) == (arr.ctypes.data, arr.nbytes)


def test_resolve_cpu_tensor_address() -> None:
    """A CPU torch tensor resolves to data_ptr and numel * element_size."""
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    info = resolve_buffer(t)
    assert (info.ptr, info.nbytes, info.cuda_device) == (t.data_ptr(), 30, None)


@pytest.mark.parametrize(
    "buffer",
    [np.zeros((4, 4))[:, ::2], torch.zeros(4, 4).t(), bytearray()],
    ids=["strided-numpy", "transposed-tensor", "empty"],
)
def test_resolve_rejects_unregistrable_buffers(buffer: object) -> None:
    """Non-contiguous or empty buffers are refused with ValueError."""
    with pytest.raises(ValueError, match="contiguous|empty"):
        resolve_buffer(buffer)


def test_registered_bytearray_cannot_be_resized() -> None:
    """The buffer export pins a bytearray while it is registered."""
    buf = bytearray(16)
    info = resolve_buffer(buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")
    del info


def test_pinned_buffer_in_garbage_cycle_is_collected() -> None:
    """A resolved buffer caught in a reference cycle is collected without crashing (a kept
    cffi from_buffer object here used to segfault the garbage collector)."""
    for _ in range(3):
        cycle: list[object] = [resolve_buffer(bytearray(64))]
        cycle.append(cycle)
        del cycle
        gc.collect()
