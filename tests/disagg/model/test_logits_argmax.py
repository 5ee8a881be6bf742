"""The greedy token's argmax in C against `torch.argmax`, the reference (X8g): random rows,
ties, NaNs, infinities and signed zeros, both dtypes; what it does not take runs torch; and a
greedy engine step asks the kernel."""

from __future__ import annotations

import math

import pytest
import torch

from disagg.engine.request import SamplingParams
from disagg.engine.sampling import sample_token
from disagg.model import logits_argmax
from disagg.model.cpu_kernels import AVX512
from disagg.model.logits_argmax import argmax, takes_kernel
from tests.disagg.model.counting_lib import CountingLib

needs_kernel = pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernel is not built)")
DTYPES = [torch.float32, torch.bfloat16]
NAN, INF = math.nan, math.inf


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 15, 16, 17, 1000, 49152, 151936])
def test_random_rows_give_torchs_index(dtype: torch.dtype, size: int) -> None:
    g = torch.Generator().manual_seed(size)
    for _ in range(20):
        row = (torch.randn(size, generator=g) * 8).to(dtype)
        assert takes_kernel(row)
        assert argmax(row) == int(torch.argmax(row))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("values", [
    [1.0, 3.0, 3.0, 2.0],  # a tie: the first
    [3.0] * 40,  # all equal: 0
    [-0.0, 0.0, -1.0],  # signed zeros are equal: the first
    [-INF] * 33,  # nothing above -inf: 0
    [1.0, INF, 2.0, INF],  # +inf is a value like any other
    [1.0, NAN, 5.0, NAN],  # a NaN counts as the largest: the first NaN
    [NAN, INF, 1.0],
    [*([0.0] * 37), NAN],  # a NaN in the masked tail
    [*([-INF] * 20), -1e30, *([-INF] * 20)],
], ids=["tie", "equal", "zeros", "all-neg-inf", "inf", "nan", "nan-first", "nan-tail",
        "one-finite"])
def test_special_values_follow_torchs_rules(dtype: torch.dtype, values: list[float]) -> None:
    row = torch.tensor(values).to(dtype)
    assert argmax(row) == int(torch.argmax(row))


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_position_of_the_maximum_is_found(dtype: torch.dtype) -> None:
    """The maximum at each index of a row of 70 (across full and masked lane groups)."""
    for index in range(70):
        row = torch.zeros(70, dtype=dtype)
        row[index] = 1.0
        assert argmax(row) == index


@pytest.mark.parametrize("case", ["float16", "batch", "strided", "empty"])
def test_what_it_does_not_take_runs_torch(case: str) -> None:
    row = {"float16": torch.randn(100).half(), "batch": torch.randn(2, 100),
           "strided": torch.randn(200)[::2], "empty": torch.empty(0)}[case]
    assert not takes_kernel(row)
    if case == "empty":
        with pytest.raises(IndexError):  # torch's own error, as before the kernel
            argmax(row)
    elif case != "batch":
        assert argmax(row) == int(torch.argmax(row))


@needs_kernel
def test_a_greedy_token_is_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingLib(logits_argmax.lib, "la_argmax", slice(2, 3))  # the row's length
    monkeypatch.setattr(logits_argmax, "lib", counting)
    logits = torch.randn(49152).bfloat16()
    assert sample_token(logits, SamplingParams(temperature=0.0)) == int(torch.argmax(logits))
    assert counting.calls == [(49152,)]
