"""What a decode step cannot beat: the memory's read bandwidth and the bytes a step reads (X8).

`engine.py` sets each engine's batch-1 decode step against its roofline, the time to read the
weights one token's step uses and its context's KV once at the bandwidth measured in the same
run. The bandwidth comes from torch's own readers on torch's threads, so the roofline is what
PyTorch could reach on this machine, not a datasheet's number.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from fractions import Fraction

import torch

from disagg.model.transformer import Transformer
from disagg.model_config import ModelConfig

# A routed expert's weights, by our parameter names ("layers.3.mlp.experts.12.up_proj.weight");
# shared experts ("shared_experts.") and dense MLPs do not match.
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
BANDWIDTH_BUFFER_BYTES = 1 << 30  # far above any last-level cache, so reads come from memory


def read_bandwidth_gbs(size_bytes: int = BANDWIDTH_BUFFER_BYTES,
                       repeats: int = 5) -> tuple[float, str]:
    """The memory's read bandwidth in GB/s on torch's current threads, and the reader that
    reached it: the best of `repeats` passes of `torch.sum` over a float32 buffer of
    `size_bytes` and of `torch.dot` of its two halves (each reads the buffer once). Two
    readers, because either may be the one whose kernel falls short of the memory's speed."""
    numel = max(2, size_bytes // 4 // 2 * 2)
    # Written, not torch.empty: an untouched page reads as the kernel's one zero page, in cache.
    buffer = torch.ones(numel)
    first, second = buffer[: numel // 2], buffer[numel // 2:]
    readers: dict[str, Callable[[], torch.Tensor]] = {
        "torch.sum": lambda: torch.sum(buffer), "torch.dot": lambda: torch.dot(first, second)}
    for read in readers.values():
        read()  # wakes the threads: not timed
    best = dict.fromkeys(readers, float("inf"))
    for _ in range(repeats):
        for name, read in readers.items():
            start = time.perf_counter()
            read()
            best[name] = min(best[name], time.perf_counter() - start)
    reader = min(best, key=best.__getitem__)
    return numel * 4 / best[reader] / 1e9, reader


def decode_weight_bytes(model: Transformer) -> int:
    """Bytes of weights one token's decode step reads in our `model`, in its dtype.

    A token passes every layer once, so every parameter counts once, with two exceptions. The
    embedding lookup reads one row of its table, which is left out; the LM head reads its whole
    [vocab, hidden] matrix, counted once whether it is the embedding's (tied) or its own. In an
    MoE layer the token visits `num_experts_per_tok` of the `num_experts` routed experts, all
    the same size, so each routed expert counts for that share of its bytes; the router, the
    attention, shared experts and dense layers count whole. Which experts a token picks does
    not matter here, but at batch > 1 the tokens' experts overlap by chance, which is why this
    is a batch-1 figure.
    """
    embedding = model.embed_tokens.weight
    moe = model.config.moe
    routed = Fraction(1) if moe is None else Fraction(moe.num_experts_per_tok, moe.num_experts)
    total = Fraction(0)
    for name, param in model.named_parameters():  # a tied head is listed once, as the embedding
        if param is not embedding:
            share = routed if ROUTED_EXPERT.search(name) else 1
            total += share * param.numel() * param.element_size()
    if model.lm_head is None:  # tied: the head is the embedding, read whole
        total += embedding.numel() * embedding.element_size()
    return round(total)


def kv_bytes(config: ModelConfig, context: int, dtype: torch.dtype) -> int:
    """Bytes of K and V that attention reads for one token after `context` tokens."""
    return context * config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize


def roofline_ms(weight_bytes: int, kv: int, bandwidth_gbs: float) -> float:
    """The time to read a step's weights and KV once at the measured bandwidth."""
    return (weight_bytes + kv) / (bandwidth_gbs * 1e9) * 1e3
