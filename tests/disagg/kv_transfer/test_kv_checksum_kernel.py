"""The KV checksum's weighted lane sum in C gives the PyTorch reference's number (X4c, X8):
same bits, every lane width, sign, head set and position, one thread or several, and a whole
checksum with the kernel equals the one without it."""

from __future__ import annotations

import pytest
import torch

from disagg.config import CacheConfig, ModelConfig
from disagg.kv_transfer import kv_checksum as checksum_module
from disagg.kv_transfer.kv_checksum import _weighted_sum, _weighted_sum_kernel, kv_checksum
from disagg.model import cpu_kernels
from disagg.model.kv_cache import PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_kernels.ENABLED, reason="CPU kernels not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def random_values(heads: int, tokens: int, width: int, dtype: torch.dtype,
                  seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(heads, tokens, width, generator=generator) * 4).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [0, 1, 37, 700], ids=lambda n: f"{n}-tokens")
def test_the_kernel_sums_what_the_reference_sums(dtype: torch.dtype, tokens: int) -> None:
    """Odd head ids, a position offset, a large seed: bit-equal."""
    values = random_values(3, tokens, 64, dtype, seed=tokens)
    head_ids = torch.tensor([1, 4, 7])
    seed, first = 2_000_000_011, 123
    positions = torch.arange(first, first + tokens)
    want = int(_weighted_sum(values, seed, positions, head_ids))
    assert _weighted_sum_kernel(values, seed, first, head_ids) == want
    assert want != 0 or tokens == 0


@pytest.mark.parametrize("width", [1, 7, 37, 72])
def test_rows_that_end_mid_vector_sum_alike(width: int) -> None:
    """Rows whose lanes are not a multiple of the kernel's 16 (fp32: twice the width, bf16:
    the width, fp8: bytes): the last partial step counts its live lanes only."""
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        values = random_values(2, 5, width, dtype, seed=width)
        head_ids = torch.tensor([3, 6])
        want = int(_weighted_sum(values, 77, torch.arange(40, 45), head_ids))
        assert _weighted_sum_kernel(values, 77, 40, head_ids) == want, dtype


def test_one_thread_or_several_give_the_same_sum() -> None:
    """One OpenMP thread against four (more than this machine may have: the split is what is
    tested), and both against the reference."""
    values = random_values(4, 2048, 64, torch.bfloat16, seed=1)
    head_ids = torch.arange(4)
    lanes = values.shape[-1]  # bfloat16: one 16-bit lane per value

    def kernel(threads: int) -> int:
        return cpu_kernels.lib.kls_lane_sum(values.data_ptr(), 2, 4, 2048, lanes,
                                            head_ids.data_ptr(), 0, 99, threads) & ((1 << 52) - 1)

    want = int(_weighted_sum(values, 99, torch.arange(2048), head_ids))
    assert kernel(1) == kernel(4) == want


@pytest.mark.parametrize("name", ["tiny", "tiny-mla-moe"])
@pytest.mark.parametrize("kv_layout", ["NHD", "HND"])
def test_a_checksum_with_the_kernel_equals_one_without(kv_layout: str, name: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole checksum over scattered pages, a held prefix left out: the kernel, which reads
    the pages in place, changes nothing a prefiller and a decoder could disagree on (K and V,
    or MLA's latent rows as one head)."""
    model = ModelConfig.from_name(name)
    cache = PagedKVCache(model, CacheConfig(page_size=4, num_pages=16, kv_layout=kv_layout))
    generator = torch.Generator().manual_seed(3)
    cache.buffer.copy_(torch.randn(cache.buffer.shape, generator=generator))
    page_ids, num_tokens = [9, 2, 14, 5, 7], 19
    with_kernel = kv_checksum(cache, page_ids, num_tokens, first_page=1)
    monkeypatch.setattr(checksum_module.cpu_kernels, "ENABLED", False)
    assert kv_checksum(cache, page_ids, num_tokens, first_page=1) == with_kernel != 0.0


def test_a_hash_input_equal_to_the_modulus_reduces_to_zero() -> None:
    """seed + position = 2^31 - 1: the remainder is 0, the edge of the kernel's reduction."""
    values = random_values(2, 4, 64, torch.float32, seed=5)
    head_ids, first = torch.tensor([0, 1]), 10
    seed = 2_147_483_647 - first
    want = int(_weighted_sum(values, seed, torch.arange(first, first + 4), head_ids))
    assert _weighted_sum_kernel(values, seed, first, head_ids) == want
