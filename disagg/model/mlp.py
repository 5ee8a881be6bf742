"""The dense SwiGLU feed-forward, column- then row-parallel under TP (S3c; in place, X8c, X8e)."""

from __future__ import annotations

import torch
from torch import nn

from disagg.model.linear import Linear
from disagg.model.swiglu import silu_mul
from disagg.model.tensor_parallel import Cut, TPShard


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), this rank's slice of the inner size.

    `all_reduce=False` leaves the partial sum to a caller that adds several (a mixture of
    experts' shared experts, `moe.py`) and reduces once.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, shard: TPShard,
                 all_reduce: bool = True) -> None:
        super().__init__()
        self.inner = shard.split(intermediate_size, "intermediate size")
        width = self.inner.stop - self.inner.start
        self.gate_proj = Linear(hidden_size, width, bias=False)
        self.up_proj = Linear(hidden_size, width, bias=False)
        self.down_proj = Linear(width, hidden_size, bias=False)
        self.shard = shard
        self.reduces = all_reduce

    def tp_cuts(self) -> dict[str, Cut]:
        """Which slice of each full weight this rank holds (names relative to this module)."""
        rows = Cut(0, self.inner.start, self.inner.stop)
        return {"gate_proj.weight": rows, "up_proj.weight": rows, "down_proj.weight": rows.along(1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return self.shard.all_reduce(out) if self.reduces else out
