"""Rotary position embeddings, indexed by each token's absolute position (S3b).

Hugging Face's rotate-half convention: dimension i pairs with i + dim/2. Precomputed cos/sin
tables up to `max_positions`.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.model_config import ModelConfig


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    @staticmethod
    def for_model(config: ModelConfig) -> RotaryEmbedding:
        """The rotation `config`'s attention applies (its RoPE dimensions and theta)."""
        return RotaryEmbedding(config.rope_dim, config.max_position_embeddings, config.rope_theta)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` ``[num_tokens, num_heads, head_dim]`` by each token's position."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
