"""RoPE's C rotation against the PyTorch rotation it replaces, bit for bit (X8c)."""

from __future__ import annotations

import pytest
import torch

from disagg.errors import KernelError
from disagg.model import rotary_kernel
from disagg.model.cpu_kernels import AVX512
from disagg.model.rope import RotaryAngles, _rotate_half
from disagg.model.rotary_kernel import rotate_half, takes_kernel
from tests.disagg.model.counting_lib import CountingLib

# The kernel splits tokens over torch's threads: test it with several, whatever xdist left.
pytestmark = [pytest.mark.skipif(not AVX512, reason="no AVX-512 (or the kernel is not built)"),
              pytest.mark.usefixtures("several_threads")]


def _inputs(tokens: int, heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    angles = torch.rand(tokens, dim, generator=g) * 100
    return x, angles.cos()[:, None].to(dtype), angles.sin()[:, None].to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The values' bits, every NaN as one pattern (PyTorch's own casts differ in its payload)."""
    bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    return bits.masked_fill(t.isnan(), -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,dim", [(1, 9, 64), (3, 3, 64), (2, 4, 80), (5, 1, 2),
                                              (1, 2, 34), (2, 16, 128), (600, 12, 64)])
def test_equals_the_pytorch_rotation_bit_for_bit(dtype: torch.dtype, tokens: int, heads: int,
                                                dim: int) -> None:
    x, cos, sin = _inputs(tokens, heads, dim, dtype)
    assert takes_kernel(x, cos)
    assert torch.equal(_bits(rotate_half(x, cos, sin)), _bits(_rotate_half(x, cos, sin)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_signed_zeros_and_non_finite_values_as_pytorch(dtype: torch.dtype) -> None:
    x, cos, sin = _inputs(2, 2, 8, dtype)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, float("nan"), float("inf")])
    x[0, 0, 4:] = torch.tensor([-0.0, 0.0, 1.0, float("-inf")])
    cos[0, 0, :] = torch.tensor([0.0, -0.0, 1.0, 0.5, -0.0, 0.0, 1.0, 0.5])
    sin[0, 0, :] = torch.tensor([-0.0, 0.0, 0.0, 0.5, 0.0, -0.0, 1.0, 0.5])
    assert torch.equal(_bits(rotate_half(x, cos, sin)), _bits(_rotate_half(x, cos, sin)))


def test_angles_rotate_through_the_kernel(monkeypatch) -> None:
    counting = CountingLib(rotary_kernel.lib, "rot_rotate_half", slice(5, 8))  # tokens, heads, dim
    monkeypatch.setattr(rotary_kernel, "lib", counting)
    x, cos, sin = _inputs(3, 2, 16, torch.float32)
    angles = RotaryAngles.of(cos[:, 0], sin[:, 0], torch.float32)
    with torch.inference_mode():
        assert torch.equal(angles.rotate(x), _rotate_half(x, cos, sin))
    assert counting.calls == [(3, 2, 16)]


@pytest.mark.parametrize("case", ["float16", "grad", "odd dim", "strided rows", "angles dtype",
                                  "empty rows"])
def test_pytorch_rotates_what_the_kernel_does_not_take(case: str) -> None:
    x, cos, sin = _inputs(2, 3, 8, torch.float32)
    if case == "float16":
        x, cos = x.half(), cos.half()
    elif case == "grad":
        x.requires_grad_(True)
    elif case == "odd dim":
        x = x[..., :7]
    elif case == "strided rows":
        x = x.transpose(0, 1)
    elif case == "empty rows":  # nothing to rotate: the reference returns the empty rows
        x, cos, sin = x[..., :0], cos[..., :0], sin[..., :0]
        assert RotaryAngles.of(cos[:, 0], sin[:, 0], x.dtype).rotate(x).shape == x.shape
    else:
        cos = cos.double()
    assert not takes_kernel(x, cos)


def test_angles_that_do_not_fit_the_rows_are_refused() -> None:
    x, cos, sin = _inputs(3, 2, 16, torch.float32)
    with pytest.raises(KernelError, match="sin"):
        rotate_half(x, cos, sin[:2])
    with pytest.raises(KernelError, match="cos"):
        rotate_half(x, cos.bfloat16(), sin)
