"""A mixture-of-experts feed-forward: Qwen3-MoE's and DeepSeek-V3's sparse layers (S9a, S9b, S3c).

The router (`moe_routing.py`) picks `num_experts_per_tok` experts per token; each expert is a
SwiGLU `MLP` of `moe_intermediate_size`, and the token's output is the routing-weighted sum of
its experts' outputs, plus, for DeepSeek, shared experts every token goes through. Parameter
names are what `save_pretrained` writes: ``gate.weight``, ``gate.e_score_correction_bias``,
``experts.{e}.{gate,up,down}_proj.weight``, ``shared_experts.{gate,up,down}_proj.weight``.

Tensor parallelism splits every expert's (and the shared experts') intermediate dimension over
the ranks, as the dense MLP does, and keeps the router whole on every rank: each rank routes
the same tokens to the same experts, computes its slice of each, and one all-reduce sums the
partial outputs of routed and shared experts together. This layout was chosen because it
needs nothing the dense model lacks: the same cuts, the same single collective per layer,
balanced work whatever the routing. Expert parallelism (whole experts spread over ranks, tokens
sent to their experts' ranks by all-to-all) is left for later: it pays when experts are many
and large (DeepSeek-V3's 256), but needs a dispatch/combine exchange, capacity or load
balancing, and a cut of whole experts rather than of rows, none of which exist here yet.
"""

from __future__ import annotations

import torch
from torch import nn

from disagg.model.mlp import MLP
from disagg.model.moe_routing import Router
from disagg.model.tensor_parallel import TPShard
from disagg.model_config import ModelConfig


class MoE(nn.Module):
    """Routed experts (and shared experts, if any), this rank's slice of each; ``forward``
    maps ``[num_tokens, hidden_size]`` to the same shape, summed over ranks."""

    def __init__(self, config: ModelConfig, shard: TPShard) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None, f"model {config.name} has no MoE config"
        self.gate = Router(config.hidden_size, moe)
        # The experts' and shared experts' own tp_cuts name every split weight.
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, moe.moe_intermediate_size, shard, all_reduce=False)
            for _ in range(moe.num_experts))
        self.shared_experts = None
        if moe.num_shared_experts:
            self.shared_experts = MLP(config.hidden_size,
                                      moe.moe_intermediate_size * moe.num_shared_experts,
                                      shard, all_reduce=False)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)  # each [num_tokens, top_k]
        # A CUDA graph cannot read which experts were hit, so a capture runs them all.
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = self.dense_experts(x, weights, experts)
        else:
            out = self.routed_experts(x, weights, experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.shard.all_reduce(out)

    def routed_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                       ) -> torch.Tensor:
        """Each expert that got any token runs once, on exactly its tokens; the weighted
        results are added back at their tokens' rows. ``[num_tokens, hidden_size]``."""
        top_k = experts.shape[1]
        flat_experts = experts.flatten()  # [num_tokens * top_k], pair p is token p // top_k
        # Pairs grouped by expert, each expert's in token order (stable sort).
        pairs = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count == 0:
                continue
            chosen = pairs[start:start + count]  # [count]
            start += count
            tokens = chosen // top_k
            y = expert(x[tokens]) * flat_weights[chosen, None]  # [count, hidden_size]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def dense_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                      ) -> torch.Tensor:
        """The same sum with static shapes: every expert on every token, weight 0 where it
        was not chosen (what a CUDA graph can capture; E times the expert FLOPs)."""
        # [num_tokens, num_experts]: a token's routing weight for each expert, mostly zeros.
        dense = weights.new_zeros(x.shape[0], len(self.experts)).scatter_(1, experts, weights)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out = out + (expert(x) * dense[:, e, None]).to(out.dtype)
        return out
