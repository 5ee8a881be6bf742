"""The decode projections' C kernel against `F.linear`, and the model actually running it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from disagg.config import CacheConfig, ModelConfig
from disagg.model import decode_layers
from disagg.model import linear as linear_module
from disagg.model.attention import AttentionMetadata, SequenceSlice
from disagg.model.cpu_kernels import AVX512, NATIVE_BF16
from disagg.model.kv_cache import PagedKVCache
from disagg.model.linear import KERNEL_ROWS, MAX_ROWS, linear, takes_kernel
from disagg.model.precision import cast_model
from disagg.model.transformer import Transformer
from tests.disagg.model.counting_lib import CountingLib

# The kernels split rows over torch's threads: test them with several, whatever xdist left.
pytestmark = pytest.mark.usefixtures("several_threads")

# float32 and bfloat16 (AVX-512 BF16's dot products where the CPU has them, their emulation
# elsewhere) both run in C wherever AVX-512 does: the CPU, not what linear.py chose to send,
# says whether a test must.
needs_kernel = pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernel is not built)")

# (out features, in features): in features with a tail after every 16 and 32 elements, a
# single element, and one shape big enough for the kernel to split it over threads.
SHAPES = [(1, 1), (17, 15), (33, 16), (5, 17), (64, 31), (40, 33), (300, 576), (4096, 72)]


def _inputs(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [*range(1, MAX_ROWS + 1), MAX_ROWS + 1, 20, KERNEL_ROWS])
def test_float32_equals_f_linear(rows: int, n: int, k: int) -> None:
    x, w, b = _inputs(rows, n, k, torch.float32, bias=rows % 2 == 0)
    assert takes_kernel(x, w, b)
    # Only the summation order differs: the error is that of k float32 additions.
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5,
                               atol=1e-5 * k ** 0.5)


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_bfloat16_is_the_rounded_float32_product(rows: int, n: int, k: int) -> None:
    x, w, b = _inputs(rows, n, k, torch.bfloat16, bias=True)
    exact = F.linear(x.double(), w.double(), b.double())
    ours = linear(x, w, b)
    assert ours.dtype == torch.bfloat16
    # One rounding of a float32 sum: at most one bf16 step from the exact value's rounding.
    step = exact.abs().clamp_min(1e-30).to(torch.bfloat16).double() * 2.0 ** -7
    assert ((ours.double() - exact).abs() <= step + 1e-3).all()
    torch.testing.assert_close(ours, F.linear(x, w, b), rtol=2 ** -7, atol=2 ** -7 * k ** 0.5)


def _vdpbf16ps_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`small_linear.c`'s bfloat16 sums by the definition of AVX-512 BF16's `vdpbf16ps`, in
    float32 numpy: per lane of 16, per 32 elements, the pair's odd product added and rounded,
    then its even one; then the lanes summed as GCC's `_mm512_reduce_add_ps` pairs them
    (halves, quarters, then lanes two apart), the bias added, the sum rounded to bfloat16."""
    m, k = x.shape
    chunks = -(-k // 32)
    pad = chunks * 32 - k
    xs = F.pad(x.float(), (0, pad)).numpy().reshape(m, 1, chunks, 16, 2)
    ws = F.pad(w.float(), (0, pad)).numpy().reshape(1, w.shape[0], chunks, 16, 2)
    acc = np.zeros((m, w.shape[0], 16), dtype=np.float32)
    for c in range(chunks):  # each product of two bfloat16 values is exact in float32
        acc = acc + xs[:, :, c, :, 1] * ws[:, :, c, :, 1]
        acc = acc + xs[:, :, c, :, 0] * ws[:, :, c, :, 0]
    eight = acc[..., 8:] + acc[..., :8]
    four = eight[..., 4:] + eight[..., :4]
    two = four[..., 2:] + four[..., :2]
    total = two[..., 0] + two[..., 1] + b.float().numpy()
    return torch.from_numpy(total).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_bfloat16_gives_the_bits_of_the_bf16_dot_product_instruction(rows: int, n: int,
                                                                      k: int) -> None:
    """With AVX-512 BF16 or without it (its emulation), the same bits: those the instruction's
    definition gives (no denormals here, which it alone would flush)."""
    x, w, b = _inputs(rows, n, k, torch.bfloat16, bias=True, seed=k)
    assert torch.equal(linear(x, w, b), _vdpbf16ps_linear(x, w, b))


@needs_kernel
def test_leading_axes_are_kept() -> None:
    x, w, _ = _inputs(6, 24, 20, torch.float32, bias=False)
    out = linear(x.view(2, 3, 20), w)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out.view(6, 24), F.linear(x, w))


@needs_kernel
def test_non_finite_values_propagate_like_the_reference() -> None:
    x, w, _ = _inputs(2, 8, 40, torch.float32, bias=False)
    x[0, 3], x[1, 5] = float("inf"), float("nan")
    assert torch.equal(linear(x, w).isnan(), F.linear(x, w).isnan())


@needs_kernel
@pytest.mark.parametrize("case", ["too many rows", "transposed weight", "float16", "grad",
                                  "bias grad", "short bias", "dtype mismatch"])
def test_the_reference_runs_what_the_kernel_does_not_take(case: str) -> None:
    x, w, b = _inputs(2, 8, 16, torch.float32, bias=True)
    if case == "too many rows":
        x = torch.randn(KERNEL_ROWS + 1, 16)
    elif case == "transposed weight":
        w = torch.randn(16, 8).t()
    elif case == "float16":
        x, w, b = x.half(), w.half(), b.half()
    elif case == "grad":
        w.requires_grad_(True)
    elif case == "bias grad":  # a frozen weight, a trained bias: its gradient must be recorded
        b.requires_grad_(True)
    elif case == "short bias":  # C would read past it; F.linear names the mismatch
        b = b[:4]
    else:
        x = x.double()
    assert not takes_kernel(x, w, b)
    if case == "short bias":
        with pytest.raises(RuntimeError):
            linear(x, w, b)
    elif case != "dtype mismatch":
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_runs_every_projection_through_the_kernel(monkeypatch,
                                                                dtype: torch.dtype) -> None:
    config = ModelConfig.from_name("tiny")
    torch.manual_seed(0)
    model = cast_model(Transformer(config).eval(), dtype)
    cache = PagedKVCache(config, CacheConfig(page_size=4, num_pages=8, dtype=dtype))
    counting = CountingLib(linear_module.lib, "sl_linear", slice(5, 8))  # rows, out, in
    monkeypatch.setattr(linear_module, "lib", counting)
    monkeypatch.setattr(decode_layers, "ENABLED", False)  # the loop's calls, not one C call
    # One decode: the token at position 2 of a request on page 0.
    meta = AttentionMetadata(torch.tensor([0]), torch.tensor([2]),
                             [SequenceSlice(0, 1, 2, torch.tensor([0]))])
    with torch.inference_mode():
        model.compute_logits(model(torch.tensor([5]), torch.tensor([2]), cache, meta))
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, \
        config.num_kv_heads * config.head_dim
    inner = config.intermediate_size
    per_layer = [(1, q, h), (1, kv, h), (1, kv, h), (1, h, q),  # q, k, v, o
                 (1, inner, h), (1, inner, h), (1, h, inner)]  # gate, up, down
    assert counting.calls == per_layer * config.num_layers + [(1, config.vocab_size, h)]


@needs_kernel
def test_the_profiler_sees_the_kernel_as_an_op() -> None:
    from torch.profiler import ProfilerActivity, profile

    from disagg.model.linear import PROFILER_NAME

    x, w, _ = _inputs(1, 32, 16, torch.float32, bias=False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        linear(x, w)
    assert [e.count for e in prof.key_averages() if e.key == PROFILER_NAME] == [1]


@pytest.mark.skipif(NATIVE_BF16, reason="this CPU multiplies bfloat16 natively")
def test_bfloat16_prefill_rows_are_multiplied_in_float32_and_rounded_once(monkeypatch) -> None:
    """Without AVX-512 BF16, PyTorch's bfloat16 GEMMs are several times slower than
    float32's: a prefill-sized product widens, multiplies in float32, rounds once."""
    seen: list[torch.dtype] = []

    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(F, name)

        @staticmethod
        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            seen.append(x.dtype)
            return F.linear(x, w, b)

    monkeypatch.setattr(linear_module, "F", Recording())
    x, w, b = _inputs(KERNEL_ROWS + 1, 40, 33, torch.bfloat16, bias=True)
    out = linear(x, w, b)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_several_projections_in_one_team_give_each_ones_bits(rows: int,
                                                             dtype: torch.dtype) -> None:
    """`sl_linear_many` (a layer's q, k and v in one fork and join): each output has the bits
    `sl_linear` gives it alone, though its rows' blocks are shared out across matrices."""
    from disagg.model._cpu_kernels import ffi

    x, _, _ = _inputs(rows, 1, 576, dtype, bias=False, seed=rows)
    weights = [_inputs(1, n, 576, dtype, bias=True, seed=n)[1:] for n in (576, 200, 40)]
    alone = [linear(x, w, b) for w, b in weights]
    outs = [torch.empty(rows, w.shape[0], dtype=dtype) for w, _ in weights]
    code = 0 if dtype == torch.float32 else 1
    addresses = [ffi.new("uintptr_t[]", [w.data_ptr() for w, _ in weights]),
                 ffi.new("uintptr_t[]", [b.data_ptr() for _, b in weights]),
                 ffi.new("uintptr_t[]", [y.data_ptr() for y in outs])]
    status = linear_module.lib.sl_linear_many(
        code, x.data_ptr(), len(weights), *addresses,
        ffi.new("int64_t[]", [w.shape[0] for w, _ in weights]), rows, 576, torch.get_num_threads())
    assert status == 0
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(outs, alone, strict=True))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [MAX_ROWS + 1, 20, KERNEL_ROWS])
def test_each_row_has_its_bits_alone_however_many_rows_come_with_it(rows: int,
                                                                   dtype: torch.dtype) -> None:
    """Beyond MAX_ROWS the kernel takes the rows in groups over chunks of the weight: every
    output row still has the bits the kernel gives that row alone (a request's numbers do not
    depend on the batch it decodes in), and a group's rows land in their own output rows."""
    x, w, b = _inputs(rows, 300, 576, dtype, bias=True, seed=rows)
    assert takes_kernel(x, w, b)
    together = linear(x, w, b)
    alone = torch.cat([linear(x[r:r + 1], w, b) for r in range(rows)])
    assert torch.equal(together, alone)
