"""RMSNorm against transformers' LlamaRMSNorm, bit for bit (S3b)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from disagg.model.norms import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [8, 576, 4096, 7168])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_equals_transformers_bit_for_bit(dtype: torch.dtype, hidden: int, rows: int) -> None:
    g = torch.Generator().manual_seed(hidden + rows)
    # Rows of very different scales: the float32 sum of squares is where orders could differ.
    x = (torch.randn(rows, hidden, generator=g)
         * torch.logspace(-3, 3, rows)[:, None]).to(dtype)
    weight = torch.randn(hidden, generator=g).to(dtype)
    ours, theirs = RMSNorm(hidden, 1e-6).to(dtype), LlamaRMSNorm(hidden, 1e-6).to(dtype)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    with torch.inference_mode():
        assert torch.equal(ours(x), theirs(x))
