"""RMSNorm: the PyTorch reference against transformers' LlamaRMSNorm bit for bit, and the C
kernel against the reference (S3b, X8c)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from disagg.config import CacheConfig, ModelConfig
from disagg.model import decode_layers, norms
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.cpu_kernels import AVX512
from disagg.model.kv_cache import PagedKVCache
from disagg.model.norms import RMSNorm, reference_rms_norm, rms_norm, takes_kernel
from disagg.model.transformer import Transformer
from tests.disagg.model.counting_lib import CountingLib

# The kernels split rows over torch's threads: test them with several, whatever xdist left.
pytestmark = pytest.mark.usefixtures("several_threads")

needs_kernel = pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernel is not built)")


def _rows(rows: int, hidden: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(hidden + rows)
    # Rows of very different scales: the float32 sum of squares is where orders could differ.
    x = (torch.randn(rows, hidden, generator=g)
         * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    return x, torch.randn(hidden, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [8, 576, 4096, 7168])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_reference_equals_transformers_bit_for_bit(dtype: torch.dtype, hidden: int,
                                                   rows: int) -> None:
    x, weight = _rows(rows, hidden, dtype)
    theirs = LlamaRMSNorm(hidden, 1e-6).to(dtype)
    theirs.weight.data.copy_(weight)
    with torch.inference_mode():
        assert torch.equal(reference_rms_norm(x, weight, 1e-6), theirs(x))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [1, 8, 17, 576, 4096, 7168])
@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_kernel_is_the_reference_but_for_the_order_of_its_sum(dtype: torch.dtype, hidden: int,
                                                             rows: int) -> None:
    x, weight = _rows(rows, hidden, dtype)
    with torch.inference_mode():
        assert takes_kernel(x, weight)
        ours, reference = rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6)
    assert ours.dtype == dtype and ours.shape == x.shape
    # The sum of squares in another order moves the scale by an ulp or two of float32: a
    # float32 result moves as much. In bfloat16 that can tip the normalised value's rounding
    # by its last bit, rarely, and the weight's product then rounds once more: two bits.
    if dtype == torch.float32:
        torch.testing.assert_close(ours, reference, rtol=2e-6, atol=0)
    else:
        two_bits = reference.float().abs() * 2.0 ** -6
        assert ((ours.float() - reference.float()).abs() <= two_bits).all()
        assert (ours != reference).float().mean() < 0.01


@needs_kernel
def test_kernel_keeps_leading_axes_and_non_finite_rows() -> None:
    x, weight = _rows(6, 40, torch.float32)
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    with torch.inference_mode():
        ours = rms_norm(x.view(2, 3, 40), weight, 1e-5)
        reference = reference_rms_norm(x, weight, 1e-5)
    assert ours.shape == (2, 3, 40)
    assert torch.equal(ours.view(6, 40).isnan(), reference.isnan())


@needs_kernel
@pytest.mark.parametrize("case", ["float16", "grad", "mixed dtypes", "strided rows",
                                  "short weight", "empty rows"])
def test_the_reference_runs_what_the_kernel_does_not_take(case: str) -> None:
    x, weight = _rows(4, 16, torch.float32)
    if case == "float16":
        x, weight = x.half(), weight.half()
    elif case == "grad":
        weight.requires_grad_(True)
    elif case == "mixed dtypes":  # a bfloat16 activation, a float32 weight: the product promotes
        x = x.bfloat16()
    elif case == "strided rows":
        x = x.t().contiguous().t()
    elif case == "empty rows":  # no width to divide by
        x, weight = x[:, :0], weight[:0]
    else:
        weight = weight[:8]
    assert not takes_kernel(x, weight)
    if case == "short weight":
        with pytest.raises(RuntimeError):
            rms_norm(x, weight, 1e-6)
    else:
        assert torch.equal(rms_norm(x, weight, 1e-6), reference_rms_norm(x, weight, 1e-6))


@needs_kernel
def test_a_decode_step_runs_every_norm_through_the_kernel(monkeypatch) -> None:
    config = ModelConfig.from_name("tiny")
    torch.manual_seed(0)
    model = Transformer(config).eval()
    cache = PagedKVCache(config, CacheConfig(page_size=4, num_pages=8))
    counting = CountingLib(norms.lib, "rn_rms_norm", slice(4, 6))  # rows, width
    monkeypatch.setattr(norms, "lib", counting)
    monkeypatch.setattr(decode_layers, "ENABLED", False)  # the loop's calls, not one C call
    meta = AttentionMetadata(torch.tensor([0]), torch.tensor([2]),
                             [SequenceSlice(0, 1, 2, torch.tensor([0]))])
    with torch.inference_mode():
        model(torch.tensor([5]), torch.tensor([2]), cache, meta)
    # Two per layer (before attention and before the MLP), then the final norm.
    assert counting.calls == [(1, config.hidden_size)] * (2 * config.num_layers + 1)


def test_the_module_is_the_function() -> None:
    x, weight = _rows(3, 24, torch.float32)
    module = RMSNorm(24, 1e-6)
    module.weight.data.copy_(weight)
    with torch.inference_mode():
        assert torch.equal(module(x), rms_norm(x, weight, 1e-6))
