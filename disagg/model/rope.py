"""Rotary position embeddings with transformers' frequency scalings, by absolute position (S3b, S9).

A forward looks its positions' cos/sin up once, for every layer (`RotaryAngles`, X8c), and on
a CPU rotates queries and keys in one C call (`rotary_kernel.py`, the same bits).

Rotate-half convention: dimension i pairs with i + dim/2. The scalings are those of
transformers' `rope_parameters` (`RopeScaling`): `linear`, `llama3` and `yarn` change the
inverse frequencies once, so their cos/sin are tables of `max_positions` rows (yarn's
attention factor multiplies both, as transformers does). `dynamic` (NTK) depends on the
sequence length, so its cos/sin are computed per forward (see `RotaryEmbedding.cos_sin`).
Partial rotary factors and `longrope` are not here; the loader refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from disagg.model import rotary_kernel
from disagg.model.attention import AttentionMetadata
from disagg.model_config import ModelConfig, RopeScaling


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """``[dim / 2]`` inverse frequencies theta^(-2i/dim) of unscaled RoPE."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling, original: int) -> torch.Tensor:
    # Llama 3.1: long wavelengths (beyond original / low_freq_factor) are slowed by `factor`,
    # short ones (below original / high_freq_factor) kept, and the band between blended.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = ((original / wavelen - scaling.low_freq_factor)
              / (scaling.high_freq_factor - scaling.low_freq_factor))
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: RopeScaling) -> float:
    """What yarn multiplies cos and sin by: `attention_factor`, else DeepSeek's ratio of two
    mscales when both are set, else 0.1 ln(factor) + 1."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
            scaling.factor, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def _yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling, original: int) -> torch.Tensor:
    # Frequencies that turn fewer than beta_slow times over the original length are
    # interpolated (divided by factor), those that turn more than beta_fast times kept, with a
    # linear ramp over the dimensions between.
    def dimension_of(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(scaling.beta_fast), dimension_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # [dim / 2]: 1 where the frequency is kept, 0 where interpolated
    wavelengths = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (scaling.factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


def sequence_lengths(positions: torch.Tensor, meta: AttentionMetadata | None) -> torch.Tensor:
    """``[num_tokens]``: for each token, its request's largest position in this forward, + 1.

    Without `meta` the tokens are one request. A pure-decode batch has one token per request,
    so it is each position + 1, with no host read (a captured decode graph replays it).
    """
    if meta is None:
        return (positions.max() + 1).expand_as(positions)
    if meta.decode_page_table is not None:
        return positions + 1
    lengths = torch.empty_like(positions)
    for seq in meta.sequences:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        lengths[rows] = positions[rows].max() + 1
    return lengths


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's absolute position, unscaled or scaled as `scaling` says."""

    def __init__(self, rope_dim: int, max_positions: int, theta: float,
                 scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.rope_dim, self.max_positions, self.theta = rope_dim, max_positions, theta
        self.scaling = scaling
        # The length the scaling was trained for; transformers falls back to the model's.
        self.original = (scaling.original_max_position_embeddings if scaling is not None
                         and scaling.original_max_position_embeddings else max_positions)
        # The tables are constants, computed on the CPU whatever the default device (the model
        # moves them with its weights), and so hold their values in a model built on the meta
        # device (`weight_shards`, `Transformer.holding`), where this arithmetic would also run
        # torch's Python reference kernels, whose first use imports torch._dynamo: a second of
        # every process's start.
        with torch.device("cpu"):
            inv_freq, self.attention_factor = self._inv_freq()
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            if self.is_dynamic:
                return
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rope_dim]
            self.register_buffer("cos", angles.cos() * self.attention_factor, persistent=False)
            self.register_buffer("sin", angles.sin() * self.attention_factor, persistent=False)

    @staticmethod
    def for_model(config: ModelConfig) -> RotaryEmbedding:
        """The rotation `config`'s attention applies (its RoPE dimensions, theta and scaling)."""
        return RotaryEmbedding(config.rope_dim, config.max_position_embeddings, config.rope_theta,
                               config.rope_scaling)

    @property
    def is_dynamic(self) -> bool:
        """Whether the frequencies depend on the sequence length (dynamic NTK)."""
        return self.scaling is not None and self.scaling.rope_type == "dynamic"

    def _inv_freq(self) -> tuple[torch.Tensor, float]:
        dim, theta, scaling = self.rope_dim, self.theta, self.scaling
        if scaling is None:
            return default_inv_freq(dim, theta), 1.0
        if scaling.rope_type == "dynamic":
            # At or below the original length NTK's base factor is 1 (computed, not assumed,
            # so it rounds as transformers' does).
            factor = scaling.factor
            base = theta * (factor * self.original / self.original - (factor - 1)) ** (
                dim / (dim - 2))
            return default_inv_freq(dim, base), 1.0
        if scaling.rope_type == "linear":
            return default_inv_freq(dim, theta) / scaling.factor, 1.0
        if scaling.rope_type == "llama3":
            return _llama3_inv_freq(default_inv_freq(dim, theta), scaling, self.original), 1.0
        return _yarn_inv_freq(dim, theta, scaling, self.original), yarn_attention_factor(scaling)

    def _dynamic_inv_freq(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, rope_dim / 2]``: NTK's base grows with the sequence length past the
        original: theta * (factor * len / original - (factor - 1)) ^ (dim / (dim - 2))."""
        assert self.scaling is not None
        dim, factor = self.rope_dim, self.scaling.factor
        longer = seq_lens.clamp(min=self.original)[:, None]  # [num_tokens, 1]
        base = self.theta * ((factor * longer / self.original) - (factor - 1)) ** (dim / (dim - 2))
        grown = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.int64,
                                            device=seq_lens.device).float() / dim)
        return torch.where(longer > self.original, grown, self.inv_freq)

    def cos_sin(self, positions: torch.Tensor, meta: AttentionMetadata | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[num_tokens, rope_dim]`` (float32) of each token's position.

        Dynamic NTK follows transformers' rule, which recomputes the frequencies from
        max(position) + 1 of each forward and leaves cached keys as they were rotated, per
        request: each token uses its request's largest position in this forward
        (`sequence_lengths`). A prompt prefilled in one chunk, then decoded, is therefore
        token-exact with transformers' `generate`. A prompt longer than the original length
        prefilled in several chunks rotates each chunk with that chunk's own length (as
        transformers would if fed the chunks one call at a time), not the whole prompt's.
        """
        if self.is_dynamic:
            inv_freq = self._dynamic_inv_freq(sequence_lengths(positions, meta))
            freqs = positions[:, None].float() * inv_freq
            angles = torch.cat((freqs, freqs), dim=-1)
            return angles.cos(), angles.sin()
        # No bounds check here: it would read a tensor on the host every layer of every step
        # (and break graph capture). The scheduler keeps every request within the model's
        # context; past the table, indexing fails (an IndexError on CPU, an assert on a GPU).
        return self.cos[positions], self.sin[positions]

    def angles(self, positions: torch.Tensor, meta: AttentionMetadata | None,
               dtype: torch.dtype) -> RotaryAngles:
        """One forward's cos and sin, for every layer to apply in `dtype` (see `cos_sin`)."""
        return RotaryAngles.of(*self.cos_sin(positions, meta), dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate `x` ``[num_tokens, num_heads, rope_dim]`` by `cos`, `sin`
        ``[num_tokens, rope_dim]``."""
        return _rotate_half(x, cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype))

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Rotate `x` ``[num_tokens, num_heads, rope_dim]`` by each token's position (`meta`:
        which tokens are whose, for dynamic NTK; without it they are one request)."""
        return self.rotate(x, *self.cos_sin(positions, meta))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` rotated by `cos`, `sin` already in its dtype and ``[num_tokens, 1, rope_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True, slots=True)
class RotaryAngles:
    """cos and sin of every token of one forward (S3b), looked up once for all its layers: per
    layer, the table lookups and casts cost a decode step more than the rotation itself.
    `cos`, `sin` are float32 ``[num_tokens, rope_dim]``; `rotate` applies them in the dtype
    `of` cast them to."""

    cos: torch.Tensor
    sin: torch.Tensor
    cast_cos: torch.Tensor  # [num_tokens, 1, rope_dim], in the forward's dtype
    cast_sin: torch.Tensor

    @staticmethod
    def of(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> RotaryAngles:
        return RotaryAngles(cos, sin, cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """`x` ``[num_tokens, num_heads, rope_dim]`` rotated by each token's position."""
        if x.dtype != self.cast_cos.dtype:
            return RotaryEmbedding.rotate(x, self.cos, self.sin)
        if rotary_kernel.takes_kernel(x, self.cast_cos):
            return rotary_kernel.rotate_half(x, self.cast_cos, self.cast_sin)
        return _rotate_half(x, self.cast_cos, self.cast_sin)
