"""Which experts each token goes to, and with what weight: a mixture of experts' router (S9a, S9b).

Two rules, named by `MoEConfig.routing`:
- "softmax" (Qwen3-MoE): a softmax over every expert's logit, the top k kept, renormalised to
  sum to one if `norm_topk_prob`.
- "sigmoid_grouped" (DeepSeek-V3): each expert scores sigmoid(logit); a learnt per-expert
  correction bias is added to steer the *choice* only (it balances load without changing the
  weights). Experts form `n_group` groups, a group scores the sum of its best two, the best
  `topk_group` groups survive and the top k are chosen among their experts. The weights are the
  unbiased scores, renormalised if `norm_topk_prob`, times `routed_scaling_factor`.

Precision follows transformers: Qwen3-MoE takes logits in the model's dtype, the softmax in
float32 and hands back weights in the model's dtype (a decode step's few rows in C,
`moe_route.c`, which `decode_layers.c` calls too, so both paths route alike, X8e); DeepSeek-V3
computes logits, scores and weights in float32 (its checkpoints keep the router and the bias in
float32 too). The router is
whole on every tensor-parallel rank: it is tiny, and every rank must route alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disagg.errors import ConfigError, KernelError
from disagg.model.cpu_kernels import DTYPE_CODES, ENABLED, lib, named_call, traced
from disagg.model.linear import KERNEL_ROWS, linear
from disagg.model_config import MoEConfig

PROFILER_NAME = "disagg::moe_route"


def softmax_top_k(logits: torch.Tensor, top_k: int, normalise: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's rule: ``[num_tokens, num_experts]`` logits -> (weights, experts), each
    ``[num_tokens, top_k]``; the weights in the logits' dtype."""
    if takes_kernel(logits):
        return named_call(PROFILER_NAME, _kernel, logits, top_k, normalise)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = probs.topk(top_k, dim=-1)
    if normalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


def takes_kernel(logits: torch.Tensor) -> bool:
    """Whether `softmax_top_k` runs in C: a decode step's rows (at most `KERNEL_ROWS`), contiguous
    float32 or bfloat16 on the CPU, no gradient to record."""
    return (ENABLED and logits.dtype in DTYPE_CODES and logits.is_cpu and logits.dim() == 2
            and 0 < logits.shape[0] <= KERNEL_ROWS and logits.is_contiguous()
            and not (torch.is_grad_enabled() and logits.requires_grad) and not traced())


def _kernel(logits: torch.Tensor, top_k: int, normalise: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, num_experts = logits.shape
    weights = logits.new_empty((rows, top_k))
    experts = torch.empty((rows, top_k), dtype=torch.int64)
    probs = torch.empty(num_experts)
    status = lib.mr_softmax_top_k(DTYPE_CODES[logits.dtype], logits.data_ptr(), rows,
                                  num_experts, top_k, int(normalise), weights.data_ptr(),
                                  experts.data_ptr(), probs.data_ptr())
    if status != 0:
        raise KernelError(f"moe routing refused the top {top_k} of {num_experts} experts")
    return weights, experts


def sigmoid_grouped_top_k(logits: torch.Tensor, bias: torch.Tensor, moe: MoEConfig
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's rule: float32 ``[num_tokens, num_experts]`` logits and the ``[num_experts]``
    correction bias -> (float32 weights, experts), each ``[num_tokens, num_experts_per_tok]``."""
    num_tokens, per_group = logits.shape[0], moe.num_experts // moe.n_group
    scores = logits.sigmoid()
    biased = scores + bias  # steers which experts win, never how much they weigh
    # [num_tokens, n_group, experts_per_group]
    grouped = biased.view(num_tokens, moe.n_group, per_group)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [num_tokens, n_group]
    best_groups = group_scores.topk(moe.topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    # Experts outside the surviving groups can never be chosen.
    biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf"))
    biased = biased.view(num_tokens, moe.num_experts)
    experts = biased.topk(moe.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, experts)
    if moe.norm_topk_prob:
        # The tiny term keeps an all-zero row (every score underflowed) finite, as upstream.
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


class Router(nn.Module):
    """The gate: ``weight`` ``[num_experts, hidden_size]`` and, for "sigmoid_grouped", the
    ``e_score_correction_bias`` ``[num_experts]`` (a parameter that is never trained, so that
    `parameter_shapes` and `load_weights` see it like any weight)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        # DeepSeek-V3's checkpoints keep the router in float32 at any precision, as
        # transformers does (`model/precision.py` leaves these parameters alone).
        self.keep_float32 = moe.routing == "sigmoid_grouped"
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.routing == "sigmoid_grouped":
            per_group = moe.num_experts // moe.n_group
            if per_group < 2:
                raise ConfigError(f"MoE n_group={moe.n_group}: a group scores its best two "
                                  f"experts, so each needs at least 2 of {moe.num_experts}")
            if moe.topk_group * per_group < moe.num_experts_per_tok:
                raise ConfigError(f"MoE topk_group={moe.topk_group} groups of {per_group} "
                                  f"experts cannot hold num_experts_per_tok="
                                  f"{moe.num_experts_per_tok}")
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(moe.num_experts, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[num_tokens, hidden_size]`` -> (weights, experts), each ``[num_tokens, top_k]``."""
        if self.e_score_correction_bias is None:
            return softmax_top_k(linear(x, self.weight), self.moe.num_experts_per_tok,
                                 self.moe.norm_topk_prob)
        logits = F.linear(x.float(), self.weight.float())
        return sigmoid_grouped_top_k(logits, self.e_score_correction_bias.float(), self.moe)
